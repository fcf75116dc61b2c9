"""The continuous-batching engine: same tokens as greedy generate, validation, cancel, stats."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from django.conf import settings

from budgets.models import ModelPrice, Provider, TokenLog
from budgets.selfhosted import per_million_micro_usd
from inference.actions import do_admit_request
from inference.engine import Engine, EngineConfig, EngineError, Sampling, in_a_passing_thread
from inference.engines import model_dir
from inference.tasks import generate
from inference.worker.throughput import report_throughput
from tests.conftest import wait_for

PROMPTS = [
    "Hi!",
    "What is the capital of Italy?",
    "Write two sentences about why cats like boxes, and mention cardboard.",
    "List three primary colours. Then explain, in a short paragraph, how mixing them gives other colours "
    "and why printers use cyan, magenta and yellow instead.",
]


@pytest.fixture(scope="module", params=["owned", "transformers"])
def engine(request):
    """Every engine test runs on both loops: Ceiling's own and transformers' continuous batching."""
    engine = Engine(EngineConfig(model_dir=model_dir(), num_blocks=64, loop=request.param))
    engine.load(progress=lambda _: None)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32).eval()


def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0]
        )
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.django_db(transaction=True)
def test_four_prompts_batched_in_the_worker_match_greedy_generate_alone(live_stack, engine, reference_model, alice, chat_feature):
    request_ids = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        request_id = uuid.uuid4().hex
        decision = do_admit_request(
            request_id=request_id, user=alice, feature=chat_feature, model="test", messages=messages,
            prompt_ids=engine.encode_chat(messages), max_tokens=40,
        )
        assert decision.admitted
        request_ids.append(request_id)
    for request_id in request_ids:  # submitted together: all four share the running batch
        generate.delay(request_id)

    def all_settled():
        logs = list(TokenLog.objects.filter(request_id__in=request_ids).exclude(status=TokenLog.Status.RUNNING))
        return logs if len(logs) == len(request_ids) else None

    wait_for(all_settled, timeout=120)
    eos_ids = engine.eos_ids_list()
    for request_id in request_ids:
        log = TokenLog.objects.select_related("transcript").get(request_id=request_id)
        assert log.status == TokenLog.Status.OK
        expected = greedy_generate(reference_model, log.transcript.prompt_ids, 40, eos_ids)
        assert log.transcript.completion_ids == expected


def _read_all(handle) -> tuple[list[int], str]:
    tokens, reason = [], None
    for event in handle.events(timeout=60):
        tokens += event.new_tokens
        reason = event.finish_reason
    return tokens, reason


def test_engine_streams_concurrent_requests_identical_to_generate(engine, reference_model):
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    handles = [engine.submit(f"cmp-{i}", ids, 24) for i, ids in enumerate(prompts)]
    results = {}
    threads = [threading.Thread(target=lambda h=h: results.__setitem__(h.request_id, _read_all(h))) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, ids in enumerate(prompts):
        tokens, reason = results[f"cmp-{i}"]
        assert tokens == greedy_generate(reference_model, ids, 24, engine.eos_ids_list())
        assert reason in ("stop", "length")
        assert reason == ("stop" if tokens[-1] in engine.eos_ids_list() else "length")


def test_max_new_tokens_is_honoured_with_eos_ignored(engine):
    handle = engine.submit("fixed", engine.encode_chat([{"role": "user", "content": "Hi"}]), 7, ignore_eos=True)
    tokens, reason = _read_all(handle)
    assert len(tokens) == 7 and reason == "length"


def test_cancel_ends_the_stream_and_frees_the_batch(engine):
    handle = engine.submit("to-cancel", engine.encode_chat([{"role": "user", "content": "Tell a long story."}]), 500)
    events = handle.events(timeout=60)
    first = next(events)
    assert first.new_tokens
    assert engine.cancel("to-cancel")
    rest = list(events)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    wait_for(lambda: engine.stats().running == 0, timeout=5)


class Listener:
    """Records what the pump hands a listened-to request, and in which thread."""

    def __init__(self, fail: bool = False) -> None:
        self.events, self.threads, self.fail = [], set(), fail

    def __call__(self, event) -> None:
        self.events.append(event)
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("a broken listener")


def test_a_listened_to_request_streams_through_the_pump_and_ends_once(engine):
    prompt = engine.encode_chat([{"role": "user", "content": "Name three rivers."}])
    listener = Listener()
    handle = engine.submit("listened", prompt, 12, ignore_eos=True, listener=listener)
    end = None
    while end is None:
        end = handle.wait_end(timeout=60)
    reference = _read_all(engine.submit("not-listened", prompt, 12, ignore_eos=True))[0]
    assert end.finished and end.finish_reason == "length"
    assert listener.events[-1] is end  # the listener saw the end before the waiter did
    assert [t for event in listener.events for t in event.new_tokens] == handle.tokens == reference
    assert threading.current_thread().name not in listener.threads and len(listener.threads) == 1
    assert handle.wait_end(timeout=0.05) is None  # nothing more comes


def test_a_failing_listener_does_not_stop_the_pump_for_other_requests(engine):
    prompt = engine.encode_chat([{"role": "user", "content": "Hi"}])
    broken = engine.submit("broken-listener", prompt, 6, ignore_eos=True, listener=Listener(fail=True))
    assert _wait_end(broken).finish_reason == "length"
    assert _read_all(engine.submit("after-broken", prompt, 6, ignore_eos=True))[1] == "length"


def test_cancelling_a_listened_to_request_ends_its_wait(engine):
    listener = Listener()
    handle = engine.submit("listened-cancel", engine.encode_chat([{"role": "user", "content": "Tell a long story."}]), 500,
                           listener=listener)
    wait_for(lambda: listener.events, timeout=60)
    assert engine.cancel("listened-cancel")
    assert _wait_end(handle).finish_reason == "cancelled"


def _wait_end(handle):
    end = None
    while end is None:
        end = handle.wait_end(timeout=60)
    return end


@pytest.mark.parametrize(
    ("limits", "message"),
    [({"CEILING_ENGINE_DEADLINE_S": 0.3}, "the answer took longer than 0 s"),
     ({"CEILING_ENGINE_FIRST_TOKEN_S": 0.001}, "the engine produced nothing for 0 s")],
)
def test_the_task_thread_enforces_the_total_and_idle_limits(engine, settings, limits, message):
    """handles.wait_for_the_end: past a limit the request is cancelled in the engine and fails."""
    from inference.worker.handles import wait_for_the_end

    for name, value in limits.items():
        setattr(settings, name, value)
    request_id = f"limits-{uuid.uuid4().hex[:8]}"
    handle = engine.submit(request_id, engine.encode_chat([{"role": "user", "content": "Tell a long story."}]), 500,
                           listener=Listener())
    assert wait_for_the_end(engine, handle) == ("error", message)
    assert engine.cancel(request_id) is False  # already cancelled: the engine stopped generating it
    wait_for(lambda: engine.stats().running == 0, timeout=10)


def test_cancelling_an_unknown_request_is_harmless(engine):
    assert engine.cancel("never-submitted") is False


@pytest.mark.parametrize(
    ("prompt_ids", "max_new_tokens", "message"),
    [([], 8, "empty"), ([1, 2, 3], 0, "at least 1"), ([1] * 2040, 100, "KV cache")],
)
def test_requests_that_would_kill_the_loop_are_refused_up_front(engine, prompt_ids, max_new_tokens, message):
    with pytest.raises(EngineError, match=message):
        engine.submit("bad", prompt_ids, max_new_tokens)
    # The manager is still alive and serving.
    tokens, _ = _read_all(engine.submit("after-bad", engine.encode_chat([{"role": "user", "content": "Hi"}]), 3))
    assert tokens


def test_sampled_requests_stream_logprobs_on_the_owned_loop_and_are_refused_on_transformers(engine):
    prompt = engine.encode_chat([{"role": "user", "content": "Name a colour."}])
    sampling = Sampling(temperature=1.0, seed=3, logprobs=True)
    if engine.loop != "owned":
        with pytest.raises(EngineError, match="sampling parameters need CEILING_ENGINE_LOOP=owned"):
            engine.submit("sampled", prompt, 4, sampling=sampling)
        return
    events = list(engine.submit("sampled", prompt, 4, ignore_eos=True, sampling=sampling).events(timeout=60))
    tokens = [token for event in events for token in event.new_tokens]
    logprobs = [entry for event in events for entry in event.new_logprobs]
    assert len(tokens) == len(logprobs) == 4 and all(value <= 0 for value, _ in logprobs)


def test_stats_report_batch_cache_and_throughput(engine):
    began = time.monotonic()
    handle = engine.submit("stats", engine.encode_chat([{"role": "user", "content": "Count to ten."}]), 40, ignore_eos=True)
    events = handle.events(timeout=60)
    next(events)
    during = engine.stats()
    list(events)
    took_s = time.monotonic() - began
    after = engine.stats()
    assert during.running == 1 and during.kv_blocks_used >= 1
    assert during.kv_blocks_total == 64
    assert after.tokens_generated >= during.tokens_generated + 1
    assert after.tokens_per_s > 0
    assert after.requests_finished >= 1
    # 40 tokens in 10 s is the load; the busy rate is the speed they were generated at, far higher
    # (on a machine so busy that they took most of the 10 s, the two rates meet).
    if took_s < 5:
        assert after.busy_tokens_per_s >= 0.95 * after.tokens_per_s  # two windows: equal within noise when gaps are short
    else:
        assert after.busy_tokens_per_s >= 0.9 * after.tokens_per_s
    assert after.peak_tokens_per_s >= after.busy_tokens_per_s
    # Its prompt over the time to its first token: at least the prompt in the time the whole answer took.
    prompt = len(engine.encode_chat([{"role": "user", "content": "Count to ten."}]))
    assert after.prefill_tokens_per_s > prompt / 10
    assert after.peak_prefill_tokens_per_s >= after.prefill_tokens_per_s
    # A lone request's decode steps, one row each: their median time (the owned loop times its steps).
    if engine.loop == "owned":
        assert 0 < after.decode_step_ms_p50["1"] < took_s * 1000
        assert json.loads(json.dumps(after.as_dict()))["decode_step_ms_p50"] == after.decode_step_ms_p50
    else:
        assert after.decode_step_ms_p50 == {}


@pytest.mark.django_db
def test_the_engines_measured_rates_price_local_tokens(engine):
    Provider.objects.create(name="local", hourly_cost_micro_usd=3_600_000, utilisation_percent=70)
    # Enough tokens for a busy rate (BUSY_MIN_TOKENS), on an engine that may have been idle for long.
    handle = engine.submit("priced", engine.encode_chat([{"role": "user", "content": "Say hello."}]), 48, ignore_eos=True)
    list(handle.events(timeout=60))
    assert report_throughput(engine) == 1
    stats = engine.stats()
    price = ModelPrice.objects.get(source=ModelPrice.Source.MEASURED)
    # Peaks only rise: measured during report_throughput, they are what it priced from, or below now's.
    assert price.output_per_million_micro_usd >= per_million_micro_usd(3_600_000, 70, stats.peak_tokens_per_s)
    assert price.input_per_million_micro_usd >= per_million_micro_usd(3_600_000, 70, stats.peak_prefill_tokens_per_s)
    assert price.model == settings.CEILING_MODEL_NAME and "measured by the workers" in price.basis


PASSING_THREAD_SCRIPT = """
import os, time, torch
from inference.engine import in_a_passing_thread
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
product = lambda: (torch.ones(512, 512) @ torch.ones(512, 512))[0, 0].item()

def settled(expected):
    # A finished team's threads exit a moment after their master: wait for the count to settle.
    deadline = time.monotonic() + 10
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

before = threads()
assert in_a_passing_thread(product) == 512.0
after_passing = settled(before)
product()
time.sleep(0.5)
print(before, after_passing, settled(before + 1))
"""


def test_load_time_torch_work_leaves_no_openmp_team_behind():
    # A thread that ran a parallel region keeps its OpenMP team while it lives; more OpenMP threads
    # than cores make libgomp stop spinning at barriers, and the engine lost a third of its speed.
    result = subprocess.run([sys.executable, "-c", PASSING_THREAD_SCRIPT], cwd=settings.BASE_DIR,
                            capture_output=True, text=True, timeout=120, check=True)
    before, after_passing, after_main = map(int, result.stdout.split())
    assert after_passing == before
    assert after_main == before + 1, "the same product in the main thread does leave its team"


def test_an_error_in_the_passing_thread_reaches_the_caller():
    def fail():
        raise ValueError("no such weights")

    with pytest.raises(ValueError, match="no such weights"):
        in_a_passing_thread(fail)
