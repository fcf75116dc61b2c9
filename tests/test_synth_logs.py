"""`manage.py synth_logs` makes realistic, repeatable synthetic ledger rows and clears them again."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db.models import Count, Sum
from django.utils import timezone

from budgets.models import Feature, ModelPrice, Provider, TokenLog
from project import stack

pytestmark = pytest.mark.django_db

SMALL = ["--rows", "2000", "--users", "50", "--days", "7"]


def run(*args) -> str:
    out = io.StringIO()
    call_command("synth_logs", *args, stdout=out)
    return out.getvalue()


def totals() -> dict:
    synthetic = TokenLog.objects.filter(request_id__startswith="synth-")
    sums = synthetic.aggregate(
        rows=Count("id"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), cost=Sum("cost_micro_usd")
    )
    by_status = dict(synthetic.values_list("status").annotate(n=Count("id")).order_by())
    return {**sums, "by_status": by_status}


def test_it_creates_the_rows_users_and_features():
    output = run(*SMALL)
    assert TokenLog.objects.filter(request_id__startswith="synth-42-").count() == 2000
    assert User.objects.filter(username__startswith="synth-user-").count() == 50
    assert not User.objects.get(username="synth-user-0001").has_usable_password()
    assert set(Feature.objects.values_list("name", flat=True)) >= {"chat", "summary", "extract"}
    assert "rows/s" in output and "created 2,000 rows" in output


def test_the_rows_look_like_real_traffic():
    run(*SMALL)
    rows = TokenLog.objects.filter(request_id__startswith="synth-")
    statuses = dict(rows.values_list("status").annotate(n=Count("id")).order_by())
    assert statuses["ok"] > 0.8 * 2000
    assert {"cancelled", "failed", "refused"} <= set(statuses)
    refused = rows.filter(status="refused")
    assert not refused.filter(refusal_code="").exists()
    assert refused.filter(refusal_code="user_tokens_per_day").exists()
    assert not refused.exclude(cost_micro_usd=0, completion_tokens=0).exists()
    ok = rows.filter(status="ok")
    assert not ok.filter(ttft_ms__isnull=True).exists()
    assert not ok.filter(cost_micro_usd__lte=0).exists()
    assert not ok.filter(total_ms__lt=1).exists()
    now = timezone.now()
    assert not rows.filter(created_at__gt=now).exists()
    assert not rows.filter(created_at__lt=now - timedelta(days=7, seconds=1)).exists()
    assert rows.values("feature").distinct().count() == 3


def test_a_few_heavy_users_make_most_requests():
    run(*SMALL)
    counts = TokenLog.objects.filter(request_id__startswith="synth-").values("user").annotate(n=Count("id"))
    per_user = sorted(counts.values_list("n", flat=True), reverse=True)
    top_tenth = sum(per_user[:5])  # 10% of 50 users
    assert top_tenth > 0.3 * 2000


def test_costs_use_the_default_providers_price_when_there_is_one():
    price = ModelPrice.objects.create(
        provider=Provider.default(), model=settings.CEILING_MODEL_NAME,
        input_per_million_micro_usd=1_000_000, output_per_million_micro_usd=2_000_000,
        effective_from=timezone.now() - timedelta(days=400),
    )
    run("--rows", "300", "--users", "10")
    row = TokenLog.objects.filter(request_id__startswith="synth-", status="ok").first()
    assert row.price == price
    assert row.cost_micro_usd == row.prompt_tokens + 2 * row.completion_tokens


def test_without_a_price_it_costs_at_fifteen_and_sixty_cents_per_million():
    run("--rows", "300", "--users", "10")
    row = TokenLog.objects.filter(request_id__startswith="synth-", status="ok").order_by("id").first()
    assert row.price is None
    assert row.cost_micro_usd == -(-(row.prompt_tokens * 150_000 + row.completion_tokens * 600_000) // 1_000_000)


def test_the_same_seed_gives_the_same_data_and_clear_removes_it():
    run(*SMALL)
    first = totals()
    assert "deleted 2,000" in run("--clear")
    assert TokenLog.objects.filter(request_id__startswith="synth-").count() == 0
    run(*SMALL)
    assert totals() == first
    # Only the times depend on when (and over how many days) it runs; every other draw stays put.
    run("--clear", *SMALL, "--days", "3")
    assert totals() == first
    run("--clear", *SMALL, "--seed", "7")  # clears, then generates with another seed
    assert totals() != first
    assert TokenLog.objects.filter(request_id__startswith="synth-7-").count() == 2000


def test_clear_leaves_real_rows_and_users_alone(alice, chat_feature):
    TokenLog.objects.create(request_id="real-1", user=alice, feature=chat_feature, model="m", status="ok",
                            created_at=timezone.now())
    run("--rows", "100", "--users", "5")
    run("--clear")
    assert list(TokenLog.objects.values_list("request_id", flat=True)) == ["real-1"]
    assert User.objects.filter(username="alice").exists()


def test_it_refuses_to_write_the_same_seed_twice():
    run("--rows", "100", "--users", "5")
    with pytest.raises(CommandError, match="already exist"):
        run("--rows", "100", "--users", "5")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rows", "0"], "--rows must be between"),
        (["--rows", "-5"], "--rows must be between"),
        (["--users", "0"], "--users must be between"),
        (["--days", "0"], "--days must be between"),
        (["--seed", "-1"], "--seed must be between"),
        (["--rows", "many"], "invalid int value"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)
    assert not TokenLog.objects.exists()


def test_bad_arguments_exit_non_zero_from_the_shell():
    result = subprocess.run(
        [sys.executable, "manage.py", "synth_logs", "--users", "0"],
        cwd=settings.BASE_DIR, capture_output=True, text=True, timeout=60,
        # The test database: a command that needs the database first checks that it is migrated.
        env={**os.environ, "DATABASE_URL": stack.database_url(settings.DATABASES["default"])},
    )
    assert result.returncode != 0
    assert "--users must be between" in result.stderr
