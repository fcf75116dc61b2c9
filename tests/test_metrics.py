"""GET /metrics: request metrics shared by every process through Redis, engine gauges per worker."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from budgets.actions import do_log_refusal
from budgets.models import Feature, TokenLog
from budgets.tags import tags_text
from inference.bus.stats import STATS_KEY_PREFIX, STATS_TTL_S
from inference.engine import EngineStats
from inference.metrics import clear_metrics, record_settled, record_settled_many
from tests.conftest import session_cookie, wait_for
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "a-long-random-scrape-token"


@pytest.fixture(autouse=True)
def _clean_metric_keys(redis_db):
    clear_metrics()
    yield


@pytest.fixture
def metrics_token(settings):
    settings.CEILING_METRICS_TOKEN = TOKEN
    return TOKEN


@pytest.fixture
def summary_feature(transactional_db):
    return Feature.objects.create(name="summary")


def settled(feature: Feature | None, status: str = TokenLog.Status.OK, model: str = "SmolLM2-135M-Instruct", **fields) -> TokenLog:
    """A ledger row as the worker leaves it; recorded as publish() records it."""
    now = timezone.now()
    row = TokenLog.objects.create(
        request_id=uuid.uuid4().hex, feature=feature, model=model, status=status,
        created_at=now, finished_at=now, **fields,
    )
    record_settled(TokenLog.objects.select_related("feature").get(pk=row.pk))
    return row


def scrape(client: Client | None = None, token: str = TOKEN) -> dict:
    response = (client or Client()).get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    return {family.name: family for family in text_string_to_metric_families(response.content.decode())}


def value(families: dict, sample: str, **labels) -> float | None:
    """The one sample whose labels include these (feature="chat" finds its model_name's series too)."""
    family = families[sample.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")]
    matches = [s.value for s in family.samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(matches) <= 1
    return matches[0] if matches else None


# --- request metrics ----------------------------------------------------------------------------------


def test_latency_histograms_count_and_sum_each_settled_request(metrics_token, chat_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=9, completion_tokens=11, ttft_ms=200, total_ms=1200)
    settled(chat_feature, finish_reason="length", prompt_tokens=9, completion_tokens=51, ttft_ms=3000, total_ms=8000)

    families = scrape()

    ttft = "ceiling:time_to_first_token_seconds"
    assert value(families, f"{ttft}_count", feature="chat") == 2
    assert value(families, f"{ttft}_sum", feature="chat") == pytest.approx(3.2)
    assert value(families, f"{ttft}_bucket", feature="chat", le="0.1") == 0
    assert value(families, f"{ttft}_bucket", feature="chat", le="0.25") == 1
    assert value(families, f"{ttft}_bucket", feature="chat", le="2.5") == 1
    assert value(families, f"{ttft}_bucket", feature="chat", le="5.0") == 2
    assert value(families, f"{ttft}_bucket", feature="chat", le="+Inf") == 2

    e2e = "ceiling:e2e_request_latency_seconds"
    assert value(families, f"{e2e}_count", feature="chat") == 2
    assert value(families, f"{e2e}_sum", feature="chat") == pytest.approx(9.2)
    assert value(families, f"{e2e}_bucket", feature="chat", le="1.0") == 0
    assert value(families, f"{e2e}_bucket", feature="chat", le="1.5") == 1
    assert value(families, f"{e2e}_bucket", feature="chat", le="10.0") == 2

    # (1200 - 200) ms over 10 tokens after the first, (8000 - 3000) over 50: 0.1 s each, and le is inclusive.
    tpot = "ceiling:time_per_output_token_seconds"
    assert value(families, f"{tpot}_count", feature="chat") == 2
    assert value(families, f"{tpot}_sum", feature="chat") == pytest.approx(0.2)
    assert value(families, f"{tpot}_bucket", feature="chat", le="0.075") == 0
    assert value(families, f"{tpot}_bucket", feature="chat", le="0.1") == 2


def test_a_one_token_answer_has_no_time_per_output_token(metrics_token, chat_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=5, completion_tokens=1, ttft_ms=300, total_ms=300)

    families = scrape()

    assert value(families, "ceiling:time_per_output_token_seconds_count", feature="chat") is None
    assert value(families, "ceiling:time_to_first_token_seconds_count", feature="chat") == 1


def test_counters_add_up_by_feature_and_finished_reason(metrics_token, chat_feature, summary_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=10, completion_tokens=5, cost_micro_usd=7, ttft_ms=50, total_ms=90)
    settled(chat_feature, finish_reason="length", prompt_tokens=20, completion_tokens=16, cost_micro_usd=9, ttft_ms=60, total_ms=400)
    settled(chat_feature, TokenLog.Status.FAILED, prompt_tokens=4)
    settled(summary_feature, TokenLog.Status.CANCELLED, finish_reason="cancelled", prompt_tokens=3, completion_tokens=2, ttft_ms=80, total_ms=100)
    settled(None, finish_reason="stop", prompt_tokens=1, completion_tokens=1, ttft_ms=10, total_ms=20)

    families = scrape()

    success = "ceiling:request_success_total"
    assert value(families, success, feature="chat", finished_reason="stop") == 1
    assert value(families, success, feature="chat", finished_reason="length") == 1
    assert value(families, success, feature="chat", finished_reason="error") == 1
    assert value(families, success, feature="summary", finished_reason="abort") == 1
    assert value(families, success, feature="(none)", finished_reason="stop") == 1
    assert value(families, "ceiling:prompt_tokens_total", feature="chat") == 34
    assert value(families, "ceiling:prompt_tokens_total", feature="summary") == 3
    assert value(families, "ceiling:generation_tokens_total", feature="chat") == 21
    assert value(families, "ceiling:generation_tokens_total", feature="summary") == 2
    assert value(families, "ceiling:cost_micro_usd_total", feature="chat") == 16
    assert value(families, "ceiling:cost_micro_usd_total", feature="summary") == 0
    # The failed request has no first token: it is in e2e latency only if it has a total.
    assert value(families, "ceiling:time_to_first_token_seconds_count", feature="chat") == 2


def test_a_batch_of_rows_adds_what_the_rows_one_by_one_add(metrics_token, chat_feature, summary_feature):
    # budgets.live announces rows in batches; each (metric, field) is added once, summed over the batch.
    def row(feature, **fields):
        now = timezone.now()
        made = TokenLog.objects.create(request_id=uuid.uuid4().hex, feature=feature, model="m", created_at=now,
                                       finished_at=now, **fields)
        return TokenLog.objects.select_related("feature").get(pk=made.pk)

    rows = [
        row(chat_feature, status=TokenLog.Status.OK, finish_reason="stop", prompt_tokens=9, completion_tokens=11,
            ttft_ms=200, total_ms=1200, cost_micro_usd=7),
        row(chat_feature, status=TokenLog.Status.OK, finish_reason="stop", prompt_tokens=1, completion_tokens=2,
            ttft_ms=250, total_ms=300, cost_micro_usd=5),
        row(summary_feature, status=TokenLog.Status.OK, finish_reason="length", prompt_tokens=4, completion_tokens=6),
        row(chat_feature, status=TokenLog.Status.REFUSED, refusal_code="user_tokens_per_day"),
        row(chat_feature, status=TokenLog.Status.RUNNING, prompt_tokens=100),  # not counted
    ]
    record_settled_many(rows)

    families = scrape()
    assert value(families, "ceiling:prompt_tokens_total", feature="chat") == 10
    assert value(families, "ceiling:generation_tokens_total", feature="chat") == 13
    assert value(families, "ceiling:cost_micro_usd_total", feature="chat") == 12
    assert value(families, "ceiling:request_success_total", feature="chat", finished_reason="stop") == 2
    assert value(families, "ceiling:request_success_total", feature="summary", finished_reason="length") == 1
    assert value(families, "ceiling:requests_refused_total", code="user_tokens_per_day") == 1
    assert value(families, "ceiling:time_to_first_token_seconds_count", feature="chat") == 2
    assert value(families, "ceiling:time_to_first_token_seconds_sum", feature="chat") == pytest.approx(0.45)
    assert value(families, "ceiling:time_to_first_token_seconds_bucket", feature="chat", le="0.25") == 2


def test_refusals_are_counted_by_code_and_nowhere_else(metrics_token, chat_feature):
    settled(chat_feature, TokenLog.Status.REFUSED, refusal_code="user_tokens_per_day", prompt_tokens=100)
    settled(chat_feature, TokenLog.Status.REFUSED, refusal_code="user_tokens_per_day", prompt_tokens=100)
    settled(chat_feature, TokenLog.Status.REFUSED, refusal_code="feature_disabled")

    families = scrape()

    assert value(families, "ceiling:requests_refused_total", code="user_tokens_per_day") == 2
    assert value(families, "ceiling:requests_refused_total", code="feature_disabled", scope="request") == 1
    assert value(families, "ceiling:requests_refused_total", code="user_tokens_per_day", scope="user") == 2
    assert families["ceiling:prompt_tokens"].samples == []
    assert families["ceiling:request_success"].samples == []


def test_a_refusal_logged_by_the_guard_reaches_the_metrics_through_publish(metrics_token, alice, chat_feature):
    do_log_refusal(
        request_id=uuid.uuid4().hex, user=alice, feature=chat_feature, model="m", code="max_input_tokens", message="Too long."
    )

    assert value(scrape(), "ceiling:requests_refused_total", code="max_input_tokens", scope="request") == 1


def test_request_metrics_carry_vllms_model_name_beside_the_feature(metrics_token, chat_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=5, completion_tokens=3, ttft_ms=100, total_ms=300)
    settled(chat_feature, finish_reason="stop", prompt_tokens=7, completion_tokens=2, ttft_ms=100, total_ms=300,
            model="SmolLM2-135M-Instruct@int8")

    families = scrape()

    assert value(families, "ceiling:prompt_tokens_total", feature="chat", model_name="SmolLM2-135M-Instruct") == 5
    assert value(families, "ceiling:prompt_tokens_total", feature="chat", model_name="SmolLM2-135M-Instruct@int8") == 7
    success = "ceiling:request_success_total"
    assert value(families, success, feature="chat", model_name="SmolLM2-135M-Instruct@int8", finished_reason="stop") == 1
    assert value(families, "ceiling:time_to_first_token_seconds_count", model_name="SmolLM2-135M-Instruct") == 1


@pytest.mark.parametrize(
    ("code", "scope"),
    [("user_tokens_per_day", "user"), ("team_feature_cost_per_month", "team"), ("key_requests_per_day", "key"),
     ("tag_cost_per_month", "tag"), ("feature_requests_per_day", "feature"), ("provider_spend", "provider"),
     ("loop_calls", "loop"), ("max_input_tokens", "request"), ("feature_disabled", "request"),
     ("guard_unavailable", "service"), ("variant_unavailable", "service")],
)
def test_each_refusal_code_has_the_scope_of_its_limit(code, scope):
    from inference.metrics import refusal_scope

    assert refusal_scope(code) == scope


def test_a_running_request_is_not_counted(metrics_token, chat_feature):
    settled(chat_feature, TokenLog.Status.RUNNING, prompt_tokens=10)

    families = scrape()

    engine_gauges = ("ceiling:num_requests", "ceiling:kv_cache", "ceiling:peak_generation")  # a live worker's, if one runs
    assert all(not family.samples for name, family in families.items() if not name.startswith(engine_gauges))


def test_prefix_cache_hits_count_cached_tokens(metrics_token, chat_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=40, cached_tokens=12, completion_tokens=3)
    settled(chat_feature, finish_reason="stop", prompt_tokens=40, cached_tokens=0, completion_tokens=3)
    settled(chat_feature, finish_reason="stop", prompt_tokens=40, cached_tokens=30, completion_tokens=3)

    assert value(scrape(), "ceiling:prefix_cache_hits_total") == 42


def test_response_cache_hits_are_declared_before_any_cache_exists(metrics_token, chat_feature):
    settled(chat_feature, finish_reason="stop", prompt_tokens=4, completion_tokens=3)

    families = scrape()

    assert families["ceiling:cache_hits"].type == "counter"
    assert families["ceiling:cache_hits"].samples == []


def test_metrics_from_several_processes_add_up_in_redis(metrics_token, chat_feature):
    # Two Django test clients stand in for two web processes: both read the one set of counters.
    settled(chat_feature, finish_reason="stop", prompt_tokens=10, completion_tokens=5)
    first = scrape(Client())
    settled(chat_feature, finish_reason="stop", prompt_tokens=10, completion_tokens=5)
    second = scrape(Client())

    assert value(first, "ceiling:prompt_tokens_total", feature="chat") == 10
    assert value(second, "ceiling:prompt_tokens_total", feature="chat") == 20


def test_engine_gauges_come_from_each_workers_published_stats_per_variant(metrics_token, redis_db):
    stats = EngineStats(model="m", device="cpu", running=3, waiting=1, kv_blocks_used=128, kv_blocks_total=512,
                        tokens_generated=0, tokens_per_s=0.0, requests_finished=0, peak_running=3, restarts=0,
                        peak_tokens_per_s=108.7)
    # A worker started with two variants (CEILING_WORKER_VARIANTS=none,int8) publishes the second beside.
    second = replace(stats, running=1, waiting=0, kv_blocks_used=0, quantization="int8", peak_tokens_per_s=75.2)
    key = f"{STATS_KEY_PREFIX}metrics-test-host:4242"
    redis_db.set(key, json.dumps(stats.as_dict() | {"variants": [second.as_dict()]}), ex=STATS_TTL_S)
    try:
        families = scrape()
    finally:
        redis_db.delete(key)

    fp32 = {"worker": "metrics-test-host:4242", "variant": "none"}
    assert value(families, "ceiling:num_requests_running", **fp32) == 3
    assert value(families, "ceiling:num_requests_waiting", **fp32) == 1
    assert value(families, "ceiling:kv_cache_usage_perc", **fp32) == 0.25
    assert value(families, "ceiling:peak_generation_tokens_per_second", **fp32) == 108.7
    int8 = fp32 | {"variant": "int8"}
    assert value(families, "ceiling:num_requests_running", **int8) == 1
    assert value(families, "ceiling:peak_generation_tokens_per_second", **int8) == 75.2


def test_recording_never_raises_when_redis_is_unreachable(metrics_token, settings, chat_feature, caplog):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1

    with caplog.at_level(logging.WARNING, logger="inference.metrics"):
        settled(chat_feature, finish_reason="stop", prompt_tokens=4, completion_tokens=3)
        response = Client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})

    assert "could not record 1 request(s)" in caplog.text
    assert response.status_code == 503


# --- the token -------------------------------------------------------------------------------------------


def test_metrics_are_off_without_a_token(settings):
    settings.CEILING_METRICS_TOKEN = ""

    assert Client().get("/metrics").status_code == 404
    assert Client().get("/metrics", headers={"Authorization": "Bearer "}).status_code == 404


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer"])
def test_a_missing_or_wrong_token_is_refused(metrics_token, header):
    response = Client().get("/metrics", headers={"Authorization": header} if header else {})

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"ceiling:" not in response.content


def test_the_right_token_gets_the_text_format(metrics_token):
    response = Client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})

    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    assert b"# TYPE ceiling:request_success_total counter" in response.content


def test_only_get_is_allowed(metrics_token):
    assert Client().post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 405


# --- end to end ----------------------------------------------------------------------------------------


def _live_scrape(live_stack, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"{live_stack.http_url}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_a_websocket_chat_is_counted_by_the_live_stack(live_stack, alice):
    # A feature of its own, so requests of other tests settling late cannot change the numbers.
    Feature.objects.create(name="metrics-e2e")
    frames = asyncio.run(chat(live_stack, session_cookie(alice), chat_frame("Say hello.", 8, feature="metrics-e2e")))
    done = frames[-1]
    assert done["type"] == "done", frames

    assert _live_scrape(live_stack, None)[0] == 401
    finished = {"feature": "metrics-e2e", "finished_reason": done["finish_reason"]}

    def counted() -> dict | None:
        # The worker that settled it sends its batch within budgets.live.FLUSH_EVERY_S of the commit.
        status, body = _live_scrape(live_stack, "test-metrics-token")
        assert status == 200
        families = {family.name: family for family in text_string_to_metric_families(body)}
        return families if value(families, "ceiling:request_success_total", **finished) else None

    families = wait_for(counted, timeout=5)
    assert value(families, "ceiling:request_success_total", **finished) == 1
    assert value(families, "ceiling:prompt_tokens_total", feature="metrics-e2e") == done["usage"]["prompt_tokens"]
    assert value(families, "ceiling:generation_tokens_total", feature="metrics-e2e") == done["usage"]["completion_tokens"]
    assert value(families, "ceiling:time_to_first_token_seconds_count", feature="metrics-e2e") == 1
    assert value(families, "ceiling:time_to_first_token_seconds_sum", feature="metrics-e2e") == pytest.approx(done["ttft_ms"] / 1000)
    assert value(families, "ceiling:e2e_request_latency_seconds_sum", feature="metrics-e2e") == pytest.approx(done["total_ms"] / 1000)

    workers = {s.labels["worker"] for s in families["ceiling:num_requests_running"].samples}
    assert workers, "no worker's engine gauges"
    assert {s.labels["worker"] for s in families["ceiling:num_requests_waiting"].samples} == workers
    assert all(0 <= s.value <= 1 for s in families["ceiling:kv_cache_usage_perc"].samples)


# --- spend by user, team and API key ---------------------------------------------------------------


def spend(families: dict, **labels) -> float | None:
    return value(families, "ceiling_spend_usd", **labels)


def test_spend_names_the_top_spenders_and_sums_the_rest_as_other(metrics_token, settings, chat_feature):
    from django.contrib.auth.models import User

    from accounts.actions import do_create_api_key
    from budgets.models import Team

    settings.CEILING_METRICS_TOP_N = 2
    team = Team.objects.create(name="research")
    users = [User.objects.create_user(name) for name in ("ann", "ben", "cat", "dan")]
    key, _ = do_create_api_key(users[0], "batch-job")
    for user, micro_usd in zip(users, (4_000_000, 3_000_000, 2_000_000, 500_000), strict=True):
        settled(chat_feature, user=user, cost_micro_usd=micro_usd, team=team if user.username in ("ann", "cat") else None,
                api_key=key if user.username == "ann" else None)

    families = scrape()

    for period in ("day", "month"):
        assert spend(families, scope_kind="user", scope="ann", period=period) == 4.0
        assert spend(families, scope_kind="user", scope="ben", period=period) == 3.0
        assert spend(families, scope_kind="user", scope="cat", period=period) is None  # beyond the top 2
        assert spend(families, scope_kind="user", scope="other", period=period) == 2.5
        assert spend(families, scope_kind="team", scope="research", period=period) == 6.0
        assert spend(families, scope_kind="team", scope="other", period=period) is None  # nothing left over
        assert spend(families, scope_kind="key", scope="ann/batch-job", period=period) == 4.0
    assert len(families["ceiling_spend_usd"].samples) == 2 * (3 + 1 + 1)


def test_spend_of_earlier_days_counts_in_the_month_only(metrics_token, alice, chat_feature):
    from budgets.periods import period_bounds

    now = timezone.now()
    day_start, month_start = period_bounds("day", now)[0], period_bounds("month", now)[0]
    if day_start == month_start:
        pytest.skip("the first day of a month has no earlier day in it")
    earlier = settled(chat_feature, user=alice, cost_micro_usd=1_000_000)
    TokenLog.objects.filter(pk=earlier.pk).update(created_at=day_start - timedelta(seconds=1))
    settled(chat_feature, user=alice, cost_micro_usd=250_000)

    families = scrape()

    assert spend(families, scope_kind="user", scope="alice", period="day") == 0.25
    assert spend(families, scope_kind="user", scope="alice", period="month") == 1.25


def test_each_cost_cap_shows_its_limit_and_what_is_left(metrics_token, alice, chat_feature):
    from budgets.models import Quota

    Quota.objects.create(user=alice, period="month", max_cost_micro_usd=5_000_000)
    settled(chat_feature, user=alice, cost_micro_usd=1_500_000)

    families = scrape()

    cap = {"scope_kind": "user", "scope": "user:alice", "period": "month"}
    assert value(families, "ceiling_budget_limit_usd", **cap) == 5.0
    assert value(families, "ceiling_budget_remaining_usd", **cap) == 3.5


# --- spend and what is left per tag ------------------------------------------------------------------


def test_spend_per_tag_names_the_top_tags_and_sums_the_rest_as_other(metrics_token, settings, alice, chat_feature):
    settings.CEILING_METRICS_TOP_N = 2
    # A row with two tags counts for both, as the guard counts it; an untagged row for no tag.
    for tags, micro_usd in ((["support", "beta"], 4_000_000), (["support"], 1_000_000), (["sales"], 2_000_000),
                            (["misc"], 500_000), ([], 9_000_000)):
        settled(chat_feature, user=alice, cost_micro_usd=micro_usd, tags=tags_text(tags))
    # Refused and still running requests spent nothing.
    settled(chat_feature, TokenLog.Status.REFUSED, user=alice, tags=tags_text(["misc"]), refusal_code="tag_cost_per_month")

    families = scrape()

    for period in ("day", "month"):
        assert spend(families, scope_kind="tag", scope="support", period=period) == 5.0
        assert spend(families, scope_kind="tag", scope="beta", period=period) == 4.0
        assert spend(families, scope_kind="tag", scope="sales", period=period) is None  # beyond the top 2
        assert spend(families, scope_kind="tag", scope="other", period=period) == 2.5  # sales and misc
    tag_samples = [s for s in families["ceiling_spend_usd"].samples if s.labels["scope_kind"] == "tag"]
    assert len(tag_samples) == 2 * 3


def test_tag_spend_of_earlier_days_counts_in_the_month_only(metrics_token, alice, chat_feature):
    from budgets.periods import period_bounds

    now = timezone.now()
    day_start, month_start = period_bounds("day", now)[0], period_bounds("month", now)[0]
    if day_start == month_start:
        pytest.skip("the first day of a month has no earlier day in it")
    earlier = settled(chat_feature, user=alice, cost_micro_usd=1_000_000, tags=tags_text(["support"]))
    TokenLog.objects.filter(pk=earlier.pk).update(created_at=day_start - timedelta(seconds=1))
    last_month = settled(chat_feature, user=alice, cost_micro_usd=7_000_000, tags=tags_text(["support"]))
    TokenLog.objects.filter(pk=last_month.pk).update(created_at=month_start - timedelta(seconds=1))
    settled(chat_feature, user=alice, cost_micro_usd=250_000, tags=tags_text(["support", "beta"]))

    families = scrape()

    assert spend(families, scope_kind="tag", scope="support", period="day") == 0.25
    assert spend(families, scope_kind="tag", scope="support", period="month") == 1.25
    assert spend(families, scope_kind="tag", scope="beta", period="month") == 0.25


def test_a_capped_tag_shows_its_limit_and_what_is_left(metrics_token, alice, chat_feature):
    from budgets.models import TagQuota

    TagQuota.objects.create(tag="support", max_cost_micro_usd=10_000_000)
    TagQuota.objects.create(tag="beta", max_cost_micro_usd=1_000_000)
    settled(chat_feature, user=alice, cost_micro_usd=4_000_000, tags=tags_text(["support", "beta"]))

    families = scrape()

    support = {"scope_kind": "tag", "scope": "tag:support", "period": "month"}
    assert value(families, "ceiling_budget_limit_usd", **support) == 10.0
    assert value(families, "ceiling_budget_remaining_usd", **support) == 6.0
    assert value(families, "ceiling_budget_remaining_usd", scope_kind="tag", scope="tag:beta", period="month") == 0.0  # spent
