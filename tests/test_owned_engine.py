"""The engine loop Ceiling owns (inference/engine/owned/): the same tokens as greedy decoding,
paged blocks shared and freed exactly, cancellation, and the fallback for models it cannot run."""

from __future__ import annotations

import pytest
import torch

from inference.engine import GREEDY, Engine, EngineConfig, EngineError, Sampling
from inference.engine.owned.blocks import BlockManager
from inference.engine.owned.manager import OwnedManager
from inference.engine.owned.runner import unsupported_reason
from inference.engine.owned.scheduler import PREFILL_AGING_S, Scheduler
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


def test_requests_arriving_together_compute_their_shared_prefix_once(model, prompts):
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=512, prefix_sharing=True)
    manager.start()
    try:
        answers = run_to_the_end(manager, {"first": prompts[1], "second": prompts[1], "other": prompts[0]}, 8)
    finally:
        manager.stop()
    assert answers["first"] == answers["second"] == greedy(model, prompts[1], 8)
    assert answers["other"] == greedy(model, prompts[0], 8)
    # The second shares every block of the first but the last; the other, the chat template's opening.
    assert manager.blocks.shared_tokens == _common_blocks(prompts[1], prompts[1], 16) + _common_blocks(prompts[0], prompts[1], 16) > 16
    assert manager.blocks.pending == {}


def _common_blocks(prompt: list[int], computed: list[int], page: int) -> int:
    """Tokens of `prompt` a request can take from `computed`'s blocks: whole equal blocks, never its last token's."""
    blocks = 0
    while blocks < (len(prompt) - 1) // page and prompt[blocks * page : (blocks + 1) * page] == computed[blocks * page : (blocks + 1) * page]:
        blocks += 1
    return blocks * page


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


def test_prompt_chunks_go_shortest_first_until_a_long_prompt_has_waited_its_aging_time():
    now = [100.0]
    scheduler = Scheduler(BlockManager(num_blocks=64, page_size=8, prefix_sharing=False), max_batch_tokens=64,
                          clock=lambda: now[0])
    long, short, shorter = (_sequence(list(range(n)), request_id=name) for n, name in ((100, "long"), (30, "short"), (10, "shorter")))
    for seq in (long, short, shorter):
        scheduler.add(seq)
    plan = scheduler.schedule()
    # The two short prompts whole, then what is left of the budget on the long one.
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("shorter", 0, 10), ("short", 0, 30), ("long", 0, 24)]
    long.computed = 24  # 76 left: a short prompt arriving now still goes first
    late = _sequence(list(range(40)), request_id="late")
    now[0] += 1.0
    scheduler.add(late)
    short.computed, shorter.computed = 30, 10  # both in decode now: one row each
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.prefill] == ["late", "long"] and len(plan.decode) == 2
    now[0] += PREFILL_AGING_S - 0.5  # the long prompt has waited its aging time (late has not): it goes first
    plan = scheduler.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("long", 24, 86)]


def test_while_requests_decode_a_step_prefills_no_more_than_the_prefill_budget():
    scheduler = Scheduler(BlockManager(num_blocks=64, page_size=8, prefix_sharing=False), max_batch_tokens=64,
                          prefill_budget=16)
    first, second = _sequence(list(range(40)), request_id="first"), _sequence(list(range(30)), request_id="second")
    scheduler.add(first)
    plan = scheduler.schedule()  # nothing decodes yet: the whole batch goes to the prompt
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("first", 0, 40)]
    first.computed = 40
    scheduler.add(second)
    plan = scheduler.schedule()  # first decodes now: second's prompt goes 16 tokens a step
    assert plan.decode == [first] and [(c.start, c.end) for c in plan.prefill] == [(0, 16)]
    second.computed = 16
    plan = scheduler.schedule()
    assert [(c.start, c.end) for c in plan.prefill] == [(16, 30)] and plan.tokens == 15
    unlimited = Scheduler(BlockManager(num_blocks=64, page_size=8, prefix_sharing=False), max_batch_tokens=64)
    decoding, waiting = _sequence(list(range(8)), request_id="d"), _sequence(list(range(100)), request_id="w")
    unlimited.add(decoding)
    unlimited.schedule()
    decoding.computed = 8
    unlimited.add(waiting)
    plan = unlimited.schedule()  # no budget: the batch's tokens left beside the decode row
    assert [(c.start, c.end) for c in plan.prefill] == [(0, 63)]


def test_at_most_max_running_requests_run_at_once_and_the_next_takes_a_freed_place():
    blocks = BlockManager(num_blocks=64, page_size=8, prefix_sharing=False)
    scheduler = Scheduler(blocks, max_batch_tokens=64, max_running=2)
    seqs = [_sequence(list(range(5 + i)), request_id=f"r{i}") for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.prefill] == ["r0", "r1"] and list(scheduler.waiting) == seqs[2:]
    assert blocks.used == 4 and all(not seq.block_table for seq in seqs[2:])  # two blocks each; the waiting hold none
    for seq in seqs[:2]:
        seq.computed = len(seq.prompt)
    assert len(scheduler.schedule().decode) == 2 and len(scheduler.running) == 2
    scheduler.finish(seqs[0])
    plan = scheduler.schedule()  # r2 takes r0's place, r3 still waits
    assert [c.seq.request_id for c in plan.prefill] == ["r2"] and plan.decode == [seqs[1]]
    assert list(scheduler.waiting) == [seqs[3]]
    assert Scheduler(blocks, max_batch_tokens=64).max_running == 64  # 0: as many as the batch's tokens
    assert Scheduler(blocks, max_batch_tokens=64, max_running=500).max_running == 64


def test_a_cpu_engine_gets_the_measured_step_limits_unless_configured_and_a_gpu_none(settings):
    from inference.engine.config import step_limits
    from inference.engines import engine_config_from_settings

    settings.CEILING_DEVICE, settings.CEILING_PREFILL_BUDGET, settings.CEILING_MAX_RUNNING = "cpu", None, None
    config = engine_config_from_settings(model_dir())
    assert (config.prefill_budget, config.max_running) == (None, 12)  # the budget: measured when it loads
    settings.CEILING_PREFILL_BUDGET, settings.CEILING_MAX_RUNNING = 0, 40
    config = engine_config_from_settings(model_dir())
    assert (config.prefill_budget, config.max_running) == (0, 40)
    assert step_limits("cuda", None, None) == (0, 0) and step_limits("cuda", 64, 8) == (64, 8)


def test_an_engine_refuses_a_kv_dtype_prefill_budget_or_max_running_it_does_not_know():
    with pytest.raises(EngineError, match="kv_dtype must be one of float32, float16"):
        EngineConfig(model_dir=model_dir(), kv_dtype="int4")
    with pytest.raises(EngineError, match="prefill_budget must be 0"):
        EngineConfig(model_dir=model_dir(), prefill_budget=-1)
    with pytest.raises(EngineError, match="max_running must be 0"):
        EngineConfig(model_dir=model_dir(), max_running=-1)


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


def test_a_request_waits_for_the_prefix_a_running_request_is_computing_then_shares_it():
    scheduler = Scheduler(BlockManager(num_blocks=32, page_size=4, prefix_sharing=True), max_batch_tokens=8)
    system = list(range(100, 112))  # three full blocks
    owner, follower = _sequence(system + [1, 2], request_id="owner"), _sequence(system + [3], request_id="follower")
    stranger = _sequence([7] * 20, request_id="stranger")
    for seq in (owner, follower, stranger):
        scheduler.add(seq)
    plan = scheduler.schedule()  # the follower is held back; the stranger behind it is not
    assert stranger in scheduler.running and [s.request_id for s in scheduler.waiting] == ["follower"]
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("owner", 0, 8)]
    for chunk in plan.prefill:  # what the loop does after a step
        chunk.seq.computed = chunk.end
        scheduler.blocks.register_computed_blocks(chunk.seq)
    scheduler.schedule()
    assert [s.request_id for s in scheduler.waiting] == ["follower"]  # the third block is still to come
    owner.computed = len(owner.prompt)
    scheduler.blocks.register_computed_blocks(owner)
    plan = scheduler.schedule()
    assert follower in scheduler.running and follower.computed == 12
    assert follower.block_table[:3] == owner.block_table[:3]
    assert (plan.prefill[0].seq, plan.prefill[0].start, plan.prefill[0].end) == (follower, 12, 13)


def test_a_held_back_request_is_admitted_on_its_own_when_the_prefix_owner_leaves():
    scheduler = Scheduler(BlockManager(num_blocks=32, page_size=4, prefix_sharing=True), max_batch_tokens=64)
    system = list(range(100, 112))
    owner, follower = _sequence(system + [1], request_id="owner"), _sequence(system + [3], request_id="follower")
    scheduler.add(owner)
    scheduler.add(follower)
    scheduler.schedule()
    assert list(scheduler.waiting) == [follower]
    scheduler.finish(owner)  # cancelled before computing anything
    assert scheduler.blocks.pending == {}
    plan = scheduler.schedule()
    assert follower in scheduler.running and follower.computed == 0
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("follower", 0, 13)]


def test_without_prefix_sharing_nothing_is_held_back():
    scheduler = Scheduler(BlockManager(num_blocks=32, page_size=4, prefix_sharing=False), max_batch_tokens=64)
    first, second = _sequence(list(range(13)), request_id="a"), _sequence(list(range(13)), request_id="b")
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.prefill] == ["a", "b"] and not scheduler.waiting


def test_the_engine_says_which_loop_runs_and_falls_back_for_a_model_it_cannot_run():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in unsupported_reason(gpt2)
    engine = Engine(EngineConfig(model_dir=model_dir(), loop="owned"))
    engine.model = gpt2
    messages: list[str] = []
    assert engine._choose_loop(messages.append) == "transformers"
    assert "cannot run this model" in messages[0] and "gpt2" in messages[0]


# --- sampling -----------------------------------------------------------------------------------


def _answers(manager: OwnedManager, requests: dict[str, tuple[list[int], Sampling]], new_tokens: int):
    for request_id, (prompt, sampling) in requests.items():
        manager.add_request(prompt, request_id, new_tokens, eos_token_id=-1, sampling=sampling)
    outputs, open_requests = {}, set(requests)
    while open_requests:
        output = manager.get_result(timeout=60)
        assert output is not None and output.error is None
        outputs[output.request_id] = output
        if output.is_finished():
            open_requests.discard(output.request_id)
    return outputs


@pytest.fixture(scope="module")
def sampling_manager(model):
    manager = OwnedManager(model, num_blocks=64, page_size=16, max_batch_tokens=64, prefix_sharing=True)
    manager.start()
    yield manager
    manager.stop()


def test_a_seed_reproduces_a_sampled_answer_whatever_shares_its_batch(sampling_manager, prompts):
    hot = Sampling(temperature=1.2, seed=7)
    alone = _answers(sampling_manager, {"alone": (prompts[0], hot)}, 16)["alone"].generated_tokens
    batched = _answers(sampling_manager, {
        "again": (prompts[0], hot),
        "other-seed": (prompts[0], Sampling(temperature=1.2, seed=8)),
        "neighbour": (prompts[1], GREEDY),
    }, 16)
    assert batched["again"].generated_tokens == alone
    assert batched["other-seed"].generated_tokens != alone
    assert batched["neighbour"].generated_tokens == greedy(sampling_manager.model, prompts[1], 16)


def test_temperature_zero_and_a_tiny_top_p_are_greedy(sampling_manager, model, prompts):
    outputs = _answers(sampling_manager, {
        "cold": (prompts[2], Sampling(temperature=0, seed=1)),
        "narrow": (prompts[2], Sampling(temperature=1.5, top_p=1e-6, seed=1)),
    }, 10)
    expected = greedy(model, prompts[2], 10)
    assert outputs["cold"].generated_tokens == expected and outputs["narrow"].generated_tokens == expected


def test_a_frequency_penalty_changes_a_repetitive_greedy_answer(sampling_manager, prompts):
    outputs = _answers(sampling_manager, {
        "plain": (prompts[2], GREEDY), "penalised": (prompts[2], Sampling(frequency_penalty=2.0)),
    }, 24)
    plain, penalised = outputs["plain"].generated_tokens, outputs["penalised"].generated_tokens
    assert penalised != plain
    assert max(penalised.count(t) for t in set(penalised)) <= max(plain.count(t) for t in set(plain))


def test_logprobs_are_the_models_own_for_the_chosen_token_and_its_alternatives(sampling_manager, model, prompts):
    output = _answers(sampling_manager, {"lp": (prompts[0], Sampling(logprobs=True, top_logprobs=3))}, 3)["lp"]
    assert len(output.logprobs) == 3
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + output.generated_tokens[:2]])).logits[0, -3:]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for position, (token, (logprob, top)) in enumerate(zip(output.generated_tokens, output.logprobs, strict=True)):
        assert logprob == pytest.approx(float(expected[position, token]), abs=1e-3)
        assert len(top) == 3 and top[0][0] == token  # greedy: the chosen token is the most likely
        assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)


@pytest.mark.parametrize("values, fragment", [
    ({"temperature": 2.5}, "temperature must be between 0 and 2"),
    ({"top_p": 0}, "top_p must be greater than 0"),
    ({"presence_penalty": -3}, "presence_penalty must be between -2 and 2"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be between 0 and 20"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
])
def test_sampling_values_out_of_range_are_refused_with_the_range(values, fragment):
    with pytest.raises(EngineError, match=fragment):
        Sampling(**values)


# Passes over the block linears by rows, as two CPUs' q4 engines timed them at load (ms): an Intel
# Xeon whose bf16 copy runs on AMX (docs/benchmarks.md, 2026-12-07) and a Zen 4 EPYC without AMX
# (docs/engine.md), where the 32-token budget was tuned; and a CPU without bf16 units (4-bit, then fp32).
XEON_AMX_STEPS = [(2, 7.0), (4, 10.3), (8, 16.1), (16, 27.5), (32, 31.3), (64, 39.4), (256, 75.5)]
ZEN4_STEPS = [(1, 5.7), (8, 12.4), (16, 21.3), (32, 44.0), (64, 59.0), (256, 162.0)]
NO_BF16_STEPS = [(1, 5.0), (8, 12.0), (16, 21.0), (32, 42.0), (64, 85.0)]


def test_the_measured_prefill_budget_is_the_largest_chunk_a_step_of_the_running_batch_can_carry():
    from inference.engine.owned.scheduler import PREFILL_CHUNKS, measured_prefill_budget

    assert measured_prefill_budget(XEON_AMX_STEPS, 12) == 128  # 12 rows ~22 ms; 140 rows ~54 (≤ 3×), 268 ~78
    assert measured_prefill_budget(ZEN4_STEPS, 12) == 32  # what was tuned there by hand
    assert measured_prefill_budget(NO_BF16_STEPS, 12) == 32  # no chunk fits 3×: the smallest, never none
    assert measured_prefill_budget(list(reversed(XEON_AMX_STEPS)), 12) == 128  # in any order
    flat = [(1, 10.0), (64, 10.0)]  # a step that costs the same at any width (a GPU's): the largest chunk
    assert measured_prefill_budget(flat, 12) == PREFILL_CHUNKS[-1]
    assert measured_prefill_budget([], 12) is None and measured_prefill_budget([(8, 5.0)], 12) is None


def test_a_configured_prefill_budget_wins_over_the_measured_one():
    engine = Engine(EngineConfig(model_dir=model_dir(), prefill_budget=48))
    said: list[str] = []
    engine.step_ms = XEON_AMX_STEPS
    assert engine._choose_prefill_budget(said.append) == 48 and said == []
    unset = Engine(EngineConfig(model_dir=model_dir(), prefill_budget=None))
    unset.step_ms = XEON_AMX_STEPS
    assert unset._choose_prefill_budget(said.append) == 128
    assert said[-1].startswith("Prefill budget beside decoding requests: 128 tokens, the largest chunk that keeps a step of 12")
    unset.step_ms = []  # a variant that times no steps (fp32, int8, bf16)
    assert unset._choose_prefill_budget(said.append) == 32 and "no step times measured" in said[-1]


@pytest.mark.parametrize("sharpness, top_p", [(8.0, 0.9), (8.0, 0.5), (0.1, 0.9), (0.1, 0.999), (3.0, 1e-6)])
def test_nucleus_filtering_keeps_what_a_sort_of_the_whole_vocabulary_keeps(sharpness, top_p):
    """The likeliest 64 tokens are looked at first, the whole vocabulary when the nucleus reaches past
    them (a flat distribution): the kept probabilities are those of a full sort either way."""
    from inference.engine.owned.sampler import _nucleus

    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(49152, generator=generator) * sharpness, dim=-1)
    ordered, order = probs.sort(descending=True)
    ordered[(ordered.cumsum(-1) - ordered) >= top_p] = 0
    expected = torch.zeros_like(probs).scatter_(-1, order, ordered)
    kept = _nucleus(probs.clone(), top_p)
    assert torch.equal(kept, expected) and int((kept > 0).sum()) >= 1


def _penalised_row_by_row(logits: torch.Tensor, seq) -> torch.Tensor:
    """The penalties as OpenAI defines them, one row at a time (the sampler's code before 2026-12-07)."""
    sampling, row = seq.sampling, logits.float().clone()
    if (sampling.presence_penalty or sampling.frequency_penalty) and seq.generated:
        ids, counts = torch.tensor(seq.generated).unique(return_counts=True)
        row[ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
    return row


def test_a_batch_penalised_in_one_update_picks_what_each_row_penalised_alone_picks():
    """Rows of every kind in one step: plain, greedy with each penalty, sampled with a seed and
    penalties, and one asking for logprobs, which are the model's, from before the penalties."""
    from inference.engine.owned.sampler import new_generator, pick_tokens

    generator = torch.Generator().manual_seed(11)
    vocab = 49152
    logits = torch.randn(6, vocab, generator=generator) * 4
    history = torch.randint(0, 200, (6, 40), generator=generator).tolist()
    kinds = [GREEDY, Sampling(frequency_penalty=0.5), Sampling(presence_penalty=1.5),
             Sampling(frequency_penalty=-0.7, presence_penalty=0.3, temperature=0.8, seed=5),
             Sampling(frequency_penalty=2.0, logprobs=True, top_logprobs=3), Sampling(temperature=1.2, top_p=0.9, seed=9)]
    rows = [Sequence(f"r{i}", [1, 2, 3], 50, frozenset(), sampling=kind) for i, kind in enumerate(kinds)]
    for seq, generated in zip(rows, history, strict=True):
        seq.generated = generated + generated[:7]  # some tokens twice, so the counts matter
        # The likeliest token, by less than any penalty here takes off it: a penalty changes the answer.
        index = rows.index(seq)
        logits[index, generated[0]] = logits[index].max() + 0.2
    expected_tokens = []
    for index, seq in enumerate(rows):
        row = _penalised_row_by_row(logits[index], seq)
        if seq.sampling.temperature > 0:
            probs = torch.softmax(row / seq.sampling.temperature, dim=-1)
            if seq.sampling.top_p < 1:
                from inference.engine.owned.sampler import _nucleus
                probs = _nucleus(probs, seq.sampling.top_p)
            expected_tokens.append(int(torch.multinomial(probs, 1, generator=new_generator(seq.sampling.seed, "cpu"))))
        else:
            expected_tokens.append(int(row.argmax()))
    logprobs_before = torch.log_softmax(logits[4], dim=-1)

    tokens, entries = pick_tokens(logits.clone(), rows)

    assert tokens == expected_tokens
    assert tokens[0] == history[0][0] and tokens[1] != history[1][0]  # the plain row keeps, a penalty moves
    assert entries[4] is not None and entries[4][0] == pytest.approx(float(logprobs_before[tokens[4]]), abs=1e-5)
    assert [token for token, _ in entries[4][1]] == logprobs_before.topk(3).indices.tolist()
    assert all(entry is None for index, entry in enumerate(entries) if index != 4)


def test_a_greedy_row_takes_the_first_of_equally_likely_tokens_as_argmax_does():
    from inference.engine.owned.sampler import greedy_tokens

    generator = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 4, (16, 49152), generator=generator).float()  # every row full of ties
    logits[3, 7] = logits[3, 40000] = 9.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert int(greedy_tokens(logits)[3]) == 7
