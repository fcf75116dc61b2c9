"""GET /healthz and GET /readyz: what a load balancer or an orchestrator probes, unauthenticated."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
from django.conf import settings
from django.test import Client, override_settings

from budgets.models import Feature
from project import stack
from tests.conftest import stack_env, stack_log_dir, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_healthz_answers_without_a_key(live_stack):
    assert get(f"{live_stack.http_url}/healthz") == (200, {"status": "ok"})


def test_readyz_is_ready_when_the_database_redis_and_a_worker_answer(live_stack, chat_feature):
    status, body = get(f"{live_stack.http_url}/readyz")

    assert status == 200 and body["status"] == "ready"
    checks = body["checks"]
    assert checks["database"]["ok"] and checks["redis"]["ok"]
    assert checks["workers"] == {settings.CEILING_QUANTIZATION: {"ok": True, "ms": checks["workers"][settings.CEILING_QUANTIZATION]["ms"],
                                                                 "queue": settings.CEILING_INFERENCE_QUEUE}}


def test_readyz_is_503_while_a_variant_in_use_has_no_worker(live_stack, chat_feature):
    Feature.objects.create(name="small", description="int8 weights", quantization="int8")

    status, body = get(f"{live_stack.http_url}/readyz")

    assert status == 503 and body["status"] == "not_ready"
    int8 = body["checks"]["workers"]["int8"]
    assert not int8["ok"] and int8["error"] == f"no worker serves the queue {settings.CEILING_INFERENCE_QUEUE}.int8"
    assert body["checks"]["workers"][settings.CEILING_QUANTIZATION]["ok"] and body["checks"]["database"]["ok"]


def test_readyz_is_503_when_redis_cannot_be_reached(transactional_db):
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0", CEILING_COUNTERS_URL=""):
        response = Client().get("/readyz")

    body = response.json()
    assert response.status_code == 503 and body["checks"]["database"]["ok"]
    assert body["checks"]["redis"] == {"ok": False, "ms": body["checks"]["redis"]["ms"], "error": "ConnectionError"}
    assert not body["checks"]["workers"][settings.CEILING_QUANTIZATION]["ok"]
    assert "127.0.0.1" not in response.content.decode()  # no host names for an unauthenticated caller


def test_readyz_follows_a_worker_that_starts_and_stops(redis_db, transactional_db):
    queue = f"readyz-{uuid.uuid4().hex[:8]}"  # a queue of its own: the suite's worker does not serve it
    with override_settings(CEILING_INFERENCE_QUEUE=queue):
        assert Client().get("/readyz").status_code == 503  # no worker yet
        worker, _ = start_worker(redis_db, stack_log_dir() / "readyz-worker.log", f"readyz@{queue}", stack_env(queue), queue)
        try:
            response = wait_for(lambda: (r := Client().get("/readyz")).status_code == 200 and r, timeout=30)
            assert response.json()["checks"]["workers"][settings.CEILING_QUANTIZATION]["queue"] == queue
        finally:
            stack.stop_all([worker])
        # Its heartbeat expires within STATS_TTL_S (5 s) of the process stopping.
        response = wait_for(lambda: (r := Client().get("/readyz")).status_code == 503 and r, timeout=20)
    error = response.json()["checks"]["workers"][settings.CEILING_QUANTIZATION]["error"]
    assert error == f"the worker that served the queue {queue} stopped its heartbeat"
