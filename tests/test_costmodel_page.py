"""The cost model page and command: prefilled from real logs, refuses nonsense, same answer twice."""

from __future__ import annotations

import io
import json
import uuid
from datetime import timedelta

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from budgets.costmodel_data import initial_from_logs
from budgets.models import TokenLog

pytestmark = pytest.mark.django_db


def make_logs(users, feature, *, prompt_median=300, prompt_sigma=0.4, output_median=120, output_sigma=0.3, per_user=40):
    rng = np.random.default_rng(3)
    now = timezone.now()
    rows = []
    for user in users:
        for _ in range(per_user):
            rows.append(TokenLog(
                request_id=uuid.uuid4().hex, user=user, feature=feature, model="m", status=TokenLog.Status.OK,
                prompt_tokens=max(1, round(rng.lognormal(np.log(prompt_median), prompt_sigma))),
                completion_tokens=max(2, round(rng.lognormal(np.log(output_median), output_sigma))),
                ttft_ms=500, total_ms=10_500, created_at=now - timedelta(days=float(rng.uniform(0, 29))),
            ))
    TokenLog.objects.bulk_create(rows)


@pytest.fixture
def many_users(django_user_model):
    return [django_user_model.objects.create(username=f"u{i}") for i in range(30)]


def test_inputs_are_prefilled_from_logs_of_known_shape(many_users, chat_feature):
    make_logs(many_users, chat_feature)
    initial, note = initial_from_logs(chat_feature)
    assert "1,200 completed requests of 30 users" in note
    assert initial["users"] == 30
    assert initial["prompt_median"] == pytest.approx(300, rel=0.05) and initial["prompt_sigma"] == pytest.approx(0.4, abs=0.03)
    assert initial["output_median"] == pytest.approx(120, rel=0.05)
    assert initial["requests_a"] == pytest.approx(40 / 30, rel=0.01)  # 40 requests in 30 days each
    assert initial["decode_tokens_per_s"] == pytest.approx(
        sum(r.completion_tokens - 1 for r in TokenLog.objects.all()) / (1200 * 10), rel=0.01
    )


def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def test_the_page_is_staff_only(alice):
    assert Client().get("/staff/costmodel/").status_code == 302
    client = Client()
    client.force_login(alice)
    assert client.get("/staff/costmodel/").status_code == 403


def test_the_page_models_a_feature_from_its_logs(staff, many_users, chat_feature):
    make_logs(many_users, chat_feature)
    response = staff_client(staff).get(f"/staff/costmodel/?feature={chat_feature.pk}")
    assert response.status_code == 200
    assert b"Prefilled from 1,200 completed requests" in response.content
    assert b"/user/month the feature" in response.content and b"cost-histogram" in response.content


@pytest.mark.parametrize(
    ("change", "message"),
    [({"users": "0"}, "greater than or equal to 1"), ({"utilisation_percent": "150", "pricing": "self"}, "less than or equal to 100"),
     ({"requests_law": "pareto", "requests_b": "0.8"}, "alpha above 1"), ({"target_usd": "-2"}, "greater than or equal to")],
)
def test_nonsense_input_is_refused_with_a_message(staff, change, message):
    from budgets.costmodel_data import DEFAULTS

    query = {**DEFAULTS, **change}
    response = staff_client(staff).get("/staff/costmodel/", query)
    assert response.status_code == 400
    assert message.encode() in response.content
    assert b"cost-histogram" not in response.content


def test_the_command_prints_json_and_gives_the_same_answer_twice(many_users, chat_feature):
    make_logs(many_users, chat_feature)
    outputs = []
    for _ in range(2):
        out = io.StringIO()
        call_command("costmodel", "--feature", "chat", "--target", "0.01", "--users", "5000", "--json", stdout=out)
        outputs.append(json.loads(out.getvalue()))
    assert outputs[0] == outputs[1]
    assert outputs[0]["users"] == 5000 and outputs[0]["per_user_month_usd"]["p99"] > 0
    assert outputs[0]["verdict"].startswith("At $0.01/user/month")


def test_the_command_refuses_bad_arguments(chat_feature):
    with pytest.raises(CommandError, match="no feature named 'nope'"):
        call_command("costmodel", "--feature", "nope", stdout=io.StringIO())
    with pytest.raises(CommandError, match="users"):
        call_command("costmodel", "--users", "0", stdout=io.StringIO())
    with pytest.raises(CommandError, match="No price for model"):
        call_command("costmodel", "--model", "gpt-unknown", stdout=io.StringIO())
