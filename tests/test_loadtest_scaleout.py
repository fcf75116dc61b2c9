"""`manage.py loadtest --web N --workers M`: real daphne and Celery processes, a real stub engine over
HTTP, a web process and a worker SIGKILLed during the run; no cap is overshot and no row is lost."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from budgets.models import TokenLog

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_scaled_out_run_with_a_web_process_and_a_worker_killed_keeps_every_ceiling(redis_db, tmp_path):
    report_path = tmp_path / "scaleout.json"
    call_command(
        "loadtest", web=2, workers=2, users=40, requests=160, concurrency=12, user_cap=3, team_cap=25,
        max_tokens=12, first_byte_ms=50, token_ms=20, kill="web,worker", json_path=str(report_path),
    )
    report = json.loads(report_path.read_text())
    ledger, ends = report["ledger"], report["client"]["ends"]
    assert report["ok"] is True
    assert ledger["overshoot"] == 0 and ledger["rows_lost"] == 0 and ledger["rows_unsettled"] == 0
    assert ledger["counter_mismatches"] == []
    # The long tail meets both kinds of cap, and the team's is met exactly.
    assert ends.get("user_requests_per_day", 0) > 0 and ends.get("team_requests_per_day", 0) > 0
    assert ledger["team_admitted"] == 25
    assert [kill["what"] for kill in report["kills"]] == ["web", "worker"]
    # Answers went on after the kills: more finished than the first 30% could give.
    assert ends["done"] > 0.3 * ledger["admitted"]
    assert ledger["admissions_per_s"] > 0 and report["latency"]["ttft_p50_ms"] > 0
    # The report's figures are the ledger's own.
    rows = TokenLog.objects.filter(user__username__startswith=f"lt{report['run']}-")
    assert rows.filter(admitted=True).count() == ledger["admitted"]
    assert not rows.filter(status=TokenLog.Status.RUNNING).exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"web": 1, "workers": 2, "kill": "web"}, "killing a web process needs --web 2"),
        ({"web": 2, "workers": 1, "kill": "worker"}, "killing a worker needs --workers 2"),
        ({"web": 2, "workers": 2, "kill": "redis-master"}, "CEILING_COUNTERS_URL"),
        ({"web": 2, "workers": 2, "kill": "database"}, "is not one of web, worker, redis-master"),
        ({"web": 2, "workers": 2, "users": 0}, "must be at least 1"),
        ({"web": 2, "workers": 2, "team_cap": 0}, "--team-cap must be at least 1"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_with_a_sentence_before_anything_starts(options, message):
    with pytest.raises(CommandError, match=message):
        call_command("loadtest", **options)
    assert not TokenLog.objects.exists()
