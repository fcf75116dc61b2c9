"""The engine loop Ceiling owns (inference/engine/owned/): the same tokens as greedy decoding,
paged blocks shared and freed exactly, cancellation, and the fallback for models it cannot run."""

from __future__ import annotations

import pytest
import torch

from inference.engine import Engine, EngineConfig
from inference.engine.owned.blocks import BlockManager
from inference.engine.owned.manager import OwnedManager
from inference.engine.owned.runner import unsupported_reason
from inference.engine.owned.sequence import Sequence
from inference.engines import model_dir
from tests.conftest import wait_for

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Explain at length.",
    "Count from one to twenty in words.",
]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from inference.engine import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    return [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in PROMPTS]


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes: no KV cache of any kind to agree with by accident."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def run_to_the_end(manager: OwnedManager, requests: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
    for request_id, prompt in requests.items():
        assert manager.add_request(prompt, request_id, new_tokens, eos_token_id=-1) == request_id
    answers, open_requests = {}, set(requests)
    while open_requests:
        output = manager.get_result(timeout=60)
        assert output is not None and output.error is None
        answers[output.request_id] = list(output.generated_tokens)
        if output.is_finished():
            open_requests.discard(output.request_id)
    return answers


def test_batched_requests_with_chunked_prefill_decode_exactly_as_greedy_alone(model, prompts):
    # A 16-token budget splits every prompt into chunks that share steps with the others' decode rows.
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=16, prefix_sharing=True)
    manager.start()
    try:
        answers = run_to_the_end(manager, {f"r{i}": p for i, p in enumerate(prompts)}, 24)
        assert manager.block_usage() == (0, 64)  # every block back once every request ended
    finally:
        manager.stop()
    for index, prompt in enumerate(prompts):
        assert answers[f"r{index}"] == greedy(model, prompt, 24)


def test_a_repeated_prompt_reuses_its_prefix_blocks_and_answers_the_same(model, prompts):
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=512, prefix_sharing=True)
    manager.start()
    try:
        first = run_to_the_end(manager, {"first": prompts[1]}, 8)["first"]
        again = run_to_the_end(manager, {"again": prompts[1]}, 8)["again"]
    finally:
        manager.stop()
    assert again == first
    assert manager.blocks.shared_tokens == (len(prompts[1]) - 1) // 16 * 16


def test_cancelling_a_running_request_frees_its_blocks_and_spares_the_others(model, prompts):
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=512, prefix_sharing=False)
    manager.start()
    try:
        manager.add_request(prompts[0], "cancelled", 200, eos_token_id=-1)
        wait_for(lambda: manager.counts()[0] == 1)
        manager.cancel_request("cancelled")
        wait_for(lambda: manager.block_usage()[0] == 0)
        answer = run_to_the_end(manager, {"other": prompts[2]}, 6)["other"]
    finally:
        manager.stop()
    assert answer == greedy(model, prompts[2], 6)


def _sequence(prompt: list[int], max_new: int = 4, request_id: str = "s") -> Sequence:
    return Sequence(request_id, prompt, max_new, frozenset())


def test_blocks_are_reserved_for_the_whole_answer_and_a_request_that_does_not_fit_waits():
    blocks = BlockManager(num_blocks=4, page_size=8, prefix_sharing=False)
    big = _sequence(list(range(20)), max_new=4)  # 24 tokens: 3 blocks
    assert blocks.allocate(big) and len(big.block_table) == 3 and blocks.used == 3
    assert not blocks.allocate(_sequence(list(range(10)), max_new=4))  # needs 2, one is free
    blocks.release(big)
    assert blocks.used == 0


def test_prefix_blocks_are_shared_revived_from_the_free_list_and_never_the_last_prompt_block():
    blocks = BlockManager(num_blocks=12, page_size=4, prefix_sharing=True)
    prompt = list(range(13))  # blocks [0-3] [4-7] [8-11] full, [12] holds the last token
    first = _sequence(prompt)
    assert blocks.allocate(first) and first.computed == 0
    first.computed = len(prompt)
    blocks.register_computed_blocks(first)
    second = _sequence(prompt)
    assert blocks.allocate(second)
    assert second.block_table[:3] == first.block_table[:3] and second.computed == 12
    assert second.block_table[3] != first.block_table[3]
    first_table = first.block_table
    blocks.release(first)
    blocks.release(second)
    third = _sequence(list(range(12)))  # its last token is in the third block: only two blocks can be shared
    assert blocks.allocate(third) and third.computed == 8
    assert third.block_table[:2] == first_table[:2]  # revived: their last users had left
    other_prefix = _sequence([99] + list(range(1, 13)))
    assert blocks.allocate(other_prefix) and other_prefix.computed == 0


def test_the_engine_says_which_loop_runs_and_falls_back_for_a_model_it_cannot_run():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in unsupported_reason(gpt2)
    engine = Engine(EngineConfig(model_dir=model_dir(), loop="owned"))
    engine.model = gpt2
    messages: list[str] = []
    assert engine._choose_loop(messages.append) == "transformers"
    assert "cannot run this model" in messages[0] and "gpt2" in messages[0]
