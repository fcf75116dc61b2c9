"""One weight variant per worker process: each variant has a queue, the web tier sends a chat to the
queue of its feature's variant, a worker serves only the variants it was started for, and a chat for a
variant no worker serves is refused at once instead of waiting in a queue nobody reads."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.core.management import call_command
from django.test import override_settings

from budgets.models import Feature, Provider, TokenLog
from inference.engine import EngineError
from inference.engines import get_engine
from inference.variants import SERVING_KEY, variant_queue, variants_in_use, worker_queues
from project import stack
from tests.conftest import (
    SHARED_QUEUE,
    session_cookie,
    shared_stack_settings,
    stack_env,
    stack_log_dir,
    start_worker,
    wait_for,
)
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = SHARED_QUEUE  # the shared stack's queue of its own: no other stack's worker takes these chats


@pytest.fixture(scope="module")
def two_variant_stack(shared_stack, redis_db, otlp_receiver):
    """daphne, a worker for the default (fp32) weights and one for int8, as runstack starts them: the
    shared stack (tests/conftest.py), and an int8 worker started here with the same settings."""
    redis_db.delete(SERVING_KEY.format(f"{QUEUE}.bf16"))
    env = stack_env(QUEUE, **shared_stack_settings(otlp_receiver), CEILING_WORKER_VARIANTS="int8")
    int8, int8_id = start_worker(redis_db, stack_log_dir() / "variants-int8-worker.log", "test-variants-int8@%h", env,
                                 queues=f"{QUEUE}.int8")
    try:
        yield shared_stack, {"none": shared_stack.worker_id, "int8": int8_id}
    finally:
        stack.stop_all([int8])


def _stats(redis_db) -> list[dict]:
    return [json.loads(raw) | {"worker": key.decode().removeprefix("ceiling:engine:")}
            for key in redis_db.scan_iter(match="ceiling:engine:*") if (raw := redis_db.get(key))]


def _worker(redis_db, worker_id: str) -> dict:
    return next(s for s in _stats(redis_db) if s["worker"] == worker_id)


def test_each_variant_has_its_own_queue_and_a_worker_serves_only_its_own():
    assert variant_queue("none") == "inference" and variant_queue("bf16") == "inference.bf16"
    assert worker_queues(["int8"]) == "inference.int8,default"
    with override_settings(CEILING_QUANTIZATION="int8"):  # an int8 stack: int8 is the default queue
        assert variant_queue("int8") == "inference" and variant_queue("none") == "inference.none"
    # This process serves the default variant only: another one is refused, not loaded beside it.
    with pytest.raises(EngineError, match="serves none weights, not bf16.*inference.bf16"):
        get_engine("bf16")


def test_runstack_starts_a_worker_for_every_variant_an_enabled_local_feature_uses(transactional_db):
    Feature.objects.create(name="a", quantization="int8")
    Feature.objects.create(name="b", quantization="int8")
    Feature.objects.create(name="off", quantization="q4", enabled=False)
    remote = Provider.objects.create(name="vllm", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://x.example/v1")
    Feature.objects.create(name="remote", quantization="bf16", provider=remote)
    assert variants_in_use() == ["none", "int8"]


def test_a_feature_on_a_second_variant_is_answered_by_that_variants_worker(two_variant_stack, redis_db, alice):
    live, workers = two_variant_stack
    Feature.objects.create(name="chat")
    Feature.objects.create(name="small", quantization="int8")
    cookie = session_cookie(alice)
    # The shared stack's fp32 worker may have answered other modules' chats before this one.
    answered_before = _worker(redis_db, workers["none"])["requests_finished"]

    small = asyncio.run(chat(live, cookie, chat_frame("What is the capital of France?", 8, feature="small")))
    assert small[-1]["type"] == "done", small[-1]
    plain = asyncio.run(chat(live, cookie, chat_frame("What is the capital of France?", 8, feature="chat")))
    assert plain[-1]["type"] == "done", plain[-1]

    int8 = wait_for(lambda: (s := _worker(redis_db, workers["int8"]))["requests_finished"] >= 1 and s, timeout=10)
    none = wait_for(lambda: (s := _worker(redis_db, workers["none"]))["requests_finished"] > answered_before and s,
                    timeout=10)
    # Each answered its own feature's chat, and neither loaded the other's weights beside its own.
    assert int8["quantization"] == "int8" and int8["requests_finished"] == 1 and not int8.get("variants")
    assert none["quantization"] == "none" and none["requests_finished"] == answered_before + 1 and not none.get("variants")
    assert int8["weights_bytes"] < none["weights_bytes"] / 1.5
    rows = {row.feature.name: row for row in TokenLog.objects.select_related("feature")}
    assert rows["small"].status == rows["chat"].status == TokenLog.Status.OK

    # /metrics has each worker's engine under its variant.
    import urllib.request

    request = urllib.request.Request(f"{live.http_url}/metrics", headers={"Authorization": "Bearer test-metrics-token"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read().decode()
    assert f'ceiling:num_requests_running{{variant="int8",worker="{workers["int8"]}"}}' in body
    assert f'ceiling:num_requests_running{{variant="none",worker="{workers["none"]}"}}' in body


def test_a_feature_on_a_variant_no_worker_serves_is_refused_at_once(two_variant_stack, alice):
    live, _ = two_variant_stack
    Feature.objects.create(name="fast", quantization="bf16")
    frames = asyncio.run(chat(live, session_cookie(alice), chat_frame("Hello?", 8, feature="fast")))
    assert [f["type"] for f in frames] == ["refused"], frames
    refused = frames[0]
    assert refused["code"] == "variant_unavailable"
    assert "No worker serves the bf16 weights" in refused["message"] and f"{QUEUE}.bf16" in refused["message"]
    row = TokenLog.objects.get()
    assert (row.status, row.refusal_code, row.admitted) == (TokenLog.Status.REFUSED, "variant_unavailable", False)


def test_a_worker_serving_a_variant_marks_its_queue_served(two_variant_stack, redis_db):
    assert redis_db.get(SERVING_KEY.format(f"{QUEUE}.int8"))
    assert not redis_db.exists(SERVING_KEY.format(f"{QUEUE}.bf16"))


def test_runstack_refuses_an_unknown_variant():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--variants: each must be one of none, int8, q4, bf16"):
        call_command("runstack", "--variants", "fp8")


def test_a_fallback_on_weights_no_worker_serves_is_no_fallback(transactional_db, redis_db):
    from inference.chat.admit import fallback_for
    from inference.web.frames import ChatFrame

    queue = SERVING_KEY.format(variant_queue("q4"))
    redis_db.delete(queue)
    small = Feature.objects.create(name="small", quantization="q4")
    chat_feature = Feature.objects.create(name="chat", fallback=small)
    frame = ChatFrame(feature="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert fallback_for(chat_feature, frame, prompt_tokens=5) is None
    redis_db.set(queue, "some-worker", ex=60)  # a q4 worker says it serves the queue
    try:
        assert fallback_for(chat_feature, frame, prompt_tokens=5).feature == small
    finally:
        redis_db.delete(queue)
