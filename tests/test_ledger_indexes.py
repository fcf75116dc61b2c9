"""TokenLog's indexes after migrations 0019-0020 (issue #23, docs/benchmarks.md "Fifth pass"): every
query shape that lost its own index is still answered through an index, and the
`counters_settled` mark is a HOT update (no index entry) on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from budgets import ledger_sql
from budgets.models import TokenLog

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's indexes and statistics")

EXPECTED = {
    "budgets_tokenlog_pkey": "(id)",
    "budgets_tokenlog_request_id_key": "(request_id)",
    "budgets_tokenlog_created_at_11ac039c": "(created_at)",
    "budgets_tokenlog_price_id_90994dbf": "(price_id)",
    "budgets_tok_feature_299b08_idx": "(feature_id, created_at)",
    "budgets_tok_user_id_61942b_idx": "(user_id, created_at)",
    "budgets_tok_provide_f4fe15_idx": "(provider_id, created_at)",
    "budgets_tok_status_b62cbe_idx": "(status, created_at)",
    "tokenlog_team_set_idx": "(team_id, created_at) WHERE (team_id IS NOT NULL)",
    "tokenlog_api_key_set_idx": "(api_key_id, created_at) WHERE (api_key_id IS NOT NULL)",
    "tokenlog_requested_feature_idx": "(requested_feature_id) WHERE (requested_feature_id IS NOT NULL)",
    "tokenlog_loop_idx": "(loop_id) WHERE (NOT ((loop_id)::text = ''::text))",
    "tokenlog_refusal_idx": "(refusal_code, created_at) WHERE (NOT ((refusal_code)::text = ''::text))",
    "tokenlog_tags_trgm_idx": "gin (tags gin_trgm_ops) WHERE ((tags)::text > ''::text)",
}


def _indexes() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'budgets_tokenlog'")
        return dict(cursor.fetchall())


@pytest.mark.django_db
def test_the_ledger_keeps_exactly_its_fourteen_indexes_and_leaves_a_fifth_of_each_page_free():
    found = _indexes()
    assert set(found) == set(EXPECTED)
    for name, tail in EXPECTED.items():
        assert found[name].endswith(tail), found[name]
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'budgets_tokenlog'")
        assert cursor.fetchone()[0] == ["fillfactor=80"]


def _queries(row: TokenLog) -> dict[str, object]:
    """The lookups whose single-column index 0019 dropped or narrowed, and the reconciliation's."""
    since = timezone.now() - timedelta(days=31)
    rows = TokenLog.objects
    return {
        "a user's rows": rows.filter(user_id=row.user_id, created_at__gte=since),
        "a user's rows, all time (SET_NULL on delete)": rows.filter(user_id=row.user_id),
        "a feature's rows (PROTECT on delete)": rows.filter(feature_id=row.feature_id),
        "a provider's rows": rows.filter(provider_id=row.provider_id, created_at__gte=since),
        "a team's rows": rows.filter(team_id=row.team_id, created_at__gte=since),
        "a key's rows (SET_NULL on delete)": rows.filter(api_key_id__in=[row.api_key_id]),
        "a fallback's rows (PROTECT on delete)": rows.filter(requested_feature_id=row.requested_feature_id),
        "one request": rows.filter(request_id=row.request_id),
        "lost requests (reconcile)": rows.filter(status=TokenLog.Status.RUNNING, created_at__lt=timezone.now()),
    }


@pytest.mark.django_db(transaction=True)
def test_every_lookup_that_lost_its_own_index_still_finds_its_rows_through_one(alice, chat_feature):
    from accounts.actions import do_create_api_key
    from budgets.models import Provider, Team

    team = Team.objects.create(name="index-team")
    provider = Provider.objects.create(name="index-provider")
    key, _ = do_create_api_key(alice, "index-key")
    row = TokenLog.objects.create(
        request_id="index-1", user=alice, feature=chat_feature, requested_feature=chat_feature,
        provider=provider, team=team, api_key=key, model="m", status=TokenLog.Status.RUNNING,
        counter_keys=[], created_at=timezone.now() - timedelta(hours=1),
    )
    TokenLog.objects.create(request_id="index-2", model="m", status=TokenLog.Status.OK, counter_keys=[],
                            created_at=timezone.now())
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")  # a plan with no usable index still scans
        for what, queryset in _queries(row).items():
            plan = queryset.explain()
            assert "Seq Scan" not in plan, f"{what}: {plan}"
            assert list(queryset.values_list("request_id", flat=True)) == ["index-1"], what


@pytest.mark.django_db(transaction=True)
def test_the_settled_mark_is_a_hot_update_and_the_finish_is_not(alice, chat_feature):
    """n_tup_hot_upd of this transaction (pg_stat_xact_user_tables): the mark changes no indexed
    column and finds room on the row's page; the finish changes `status`, which is indexed."""
    from budgets.actions import Usage, do_record_usage

    row = ledger_sql.new_row({
        "request_id": "hot-1", "user": alice, "feature": chat_feature, "provider": chat_feature.provider,
        "model": "m", "status": TokenLog.Status.RUNNING, "prompt_tokens": 3, "max_tokens": 5, "admitted": True,
        "counter_keys": [], "created_at": timezone.now(),
    })
    with transaction.atomic():
        ledger_sql.insert(row)
        finished = do_record_usage("hot-1", status=TokenLog.Status.OK, usage=Usage(3, 2), admitted=row)
        assert finished is not None and finished.status == TokenLog.Status.OK
        assert ledger_sql.mark_settled([row.pk]) == 1
        with connection.cursor() as cursor:
            cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
                           "WHERE relname = 'budgets_tokenlog'")
            updated, hot = cursor.fetchone()
    assert (updated, hot) == (2, 1)  # a page with room here; the fillfactor keeps room at gateway rates
    assert TokenLog.objects.get(pk=row.pk).counters_settled


@pytest.mark.django_db(transaction=True)
def test_a_tags_rows_are_found_through_the_trigram_index_on_tagged_rows_and_untagged_rows_stay_out(alice):
    from budgets import charts, forecast
    from budgets.guard import Scopes, _tag_ceilings
    from budgets.models import TagQuota
    from budgets.tags import tag_filter, tags_text

    now = timezone.now()
    for i, tags in enumerate([["support"], ["support", "beta"], ["supportive"], []]):
        TokenLog.objects.create(request_id=f"tag-{i}", user=alice, model="m", status=TokenLog.Status.OK,
                                tags=tags_text(tags), counter_keys=[], created_at=now - timedelta(minutes=i))
    quota = TagQuota.objects.create(tag="support", max_cost_micro_usd=10**9)
    guard_filter = _tag_ceilings(Scopes(tag_quotas=(quota,)), now)[0].ledger_filter
    assert guard_filter.items() >= tag_filter("support").items()  # the rebuild's filter is this one, bounded by the month
    queries = {
        "the guard's rebuild": TokenLog.objects.filter(**guard_filter),
        "the token log's and the charts' filter": charts._tagged("support"),
    }
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")  # a plan with no usable index still scans
        plan = TokenLog.objects.filter(**tag_filter("support")).explain()
        assert "tokenlog_tags_trgm_idx" in plan, plan  # tags > '' matches the partial index's predicate
        for what, queryset in queries.items():
            assert sorted(queryset.values_list("request_id", flat=True)) == ["tag-0", "tag-1"], what
    histories = forecast.tag_histories(["support"], now - timedelta(days=1), now + timedelta(minutes=1))
    assert list(histories) == [(forecast.TAG_GROUP, ("support",))]
