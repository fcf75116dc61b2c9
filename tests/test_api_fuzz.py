"""Schemathesis throws generated requests at the live /v1 API, described by /v1/openapi.json.

Every response must be documented (status, content type, body schema, headers), none may be a 500,
bodies that break the schema must be refused, and the ledger must gain a row exactly when a request
was admitted or refused by the guard: never for a request that was rejected as malformed.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from django.core.management import call_command
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from accounts.actions import do_create_api_key
from budgets.models import TokenLog
from inference.openapi import openapi_document

pytestmark = pytest.mark.django_db(transaction=True)

# The chat and the model list, as fuzzed since the start; the legacy completions share the chat's
# path after their own parsing (tests/test_openai_api.py), and a model lookup is one list entry.
SCHEMA = schemathesis.openapi.from_dict(openapi_document()).include(path=["/v1/chat/completions", "/v1/models"])
# Not schemathesis' not_a_server_error: a documented 503 (the engine gave up on a slow machine) is an
# honest answer; a 500 never is, and call_and_check_the_ledger refuses it.
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
# Each admitted example runs the real model: answers are 2 tokens, alice may make ADMITTED requests
# a day (the rest are refused by the guard, cheaply, which fuzzes the refusal path too), and a
# failure is reported as found: shrinking against a live server would take minutes.
# One, so that two well-formed chat requests among the 25 examples exercise both paths: schemathesis'
# examples vary from run to run despite derandomize (a CI run drew only 2 of 25 that the guard saw).
ADMITTED = 1
FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# The positive run draws more: most well-formed documents still break a rule the schema cannot say
# (the last message from the user, a known feature or model), and with the gateway's growing body
# (tags, metadata, tools, response formats) 25 drew a single chat the guard saw in one suite run.
POSITIVE_FUZZ = settings(FUZZ, max_examples=60)
STATS = {"requests": 0, "models": 0, "admitted": 0, "refused": 0, "rejected": 0, "unavailable": 0, "500s": 0}


@pytest.fixture
def api(live_stack, alice, chat_feature):
    chat_feature.max_output_tokens = 2
    chat_feature.max_input_tokens = 256  # long generated prompts are refused (and logged), not computed
    chat_feature.save(update_fields=["max_output_tokens", "max_input_tokens"])
    call_command("set_quota", "alice", "--period", "day", "--requests", str(ADMITTED))
    _, plaintext = do_create_api_key(alice, "fuzz")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {plaintext}"
    yield live_stack.http_url, session
    session.close()


def is_guard_refusal(response: requests.Response) -> bool:
    if response.status_code in (403, 429):
        return True
    return response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def call_and_check_the_ledger(case, base_url: str, session: requests.Session, checks: list) -> None:
    rows_before = TokenLog.objects.count()
    response = case.call_and_validate(base_url=base_url, session=session, checks=checks, timeout=120)
    added = TokenLog.objects.count() - rows_before
    STATS["requests"] += 1
    STATS["500s"] += response.status_code == 500
    assert response.status_code != 500, response.text[:300]
    if response.status_code == 200 and case.path == "/v1/models":
        STATS["models"] += 1
        assert added == 0
    elif response.status_code == 200:
        STATS["admitted"] += 1
        # schemathesis' response: lower-case header names, each with a list of values
        row = TokenLog.objects.get(request_id=response.headers["x-request-id"][0])
        assert row.status != TokenLog.Status.REFUSED and added == 1
    elif response.status_code == 503:  # admitted, then the engine (or the guard) gave up: logged, released
        STATS["unavailable"] += 1
        assert added == 1
    elif is_guard_refusal(response):
        STATS["refused"] += 1
        assert added == 1 and TokenLog.objects.order_by("-id").first().status == TokenLog.Status.REFUSED
    else:
        STATS["rejected"] += 1
        assert added == 0, f"{response.status_code} {response.text[:200]} left a ledger row"


def test_valid_requests_are_answered_as_documented(api):
    base_url, session = api

    @POSITIVE_FUZZ
    @given(case=SCHEMA.as_strategy(GenerationMode.POSITIVE))
    def fuzz(case):
        call_and_check_the_ledger(case, base_url, session, CHECKS)

    fuzz()
    print("positive:", STATS)
    assert STATS["admitted"] >= 1 and STATS["refused"] >= 1


def test_invalid_requests_are_refused_without_a_ledger_row(api):
    base_url, session = api

    @FUZZ
    @given(case=SCHEMA.as_strategy(GenerationMode.NEGATIVE))
    def fuzz(case):
        call_and_check_the_ledger(case, base_url, session, [*CHECKS, negative_data_rejection])

    fuzz()
    print("positive and negative:", STATS)
    assert STATS["rejected"] >= 10


def test_the_served_document_is_the_one_the_fuzzer_uses(api):
    base_url, session = api
    response = requests.get(f"{base_url}/v1/openapi.json", timeout=10)
    assert response.status_code == 200 and response.json() == openapi_document()
