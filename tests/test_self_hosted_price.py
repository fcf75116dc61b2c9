"""Self-hosted tokens, priced: a local provider's hourly cost ÷ the tokens its engine serves per hour,
recorded as a `measured` ModelPrice, re-derived when staff change the cost or a worker measures more,
and counted against caps and provider limits like a hosted price."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets import costmodel
from budgets.actions import Usage, do_price_local_tokens, do_record_throughput, do_record_usage
from budgets.guard import AdmissionRequest, admit, settle
from budgets.models import AuditEntry, ModelPrice, Provider, Quota, TokenLog
from budgets.selfhosted import LocalCost, per_million_micro_usd

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = settings.CEILING_MODEL_NAME


@pytest.fixture
def local() -> Provider:
    provider = Provider.default()
    provider.decode_tokens_per_s, provider.prefill_tokens_per_s = 2_400.0, 24_000.0
    provider.throughput_measured_at = timezone.now()
    provider.save()
    return provider


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def provider_data(provider: Provider, **changes) -> dict:
    return {"form": "provider", "name": provider.name, "kind": provider.kind, "monthly_limit_usd": "",
            "thresholds": "50, 80, 100", "recipients": "", "utilisation_percent": str(provider.utilisation_percent),
            "hourly_cost_usd": "", **changes}


def local_prices() -> list[ModelPrice]:
    return list(ModelPrice.objects.filter(source=ModelPrice.Source.MEASURED).order_by("effective_from"))


# --- the formula ---------------------------------------------------------------------------------


def test_the_seeds_worked_example_costs_0_1786_per_1000_responses():
    """2,400 tok/s, 300 tokens per response, $3.60/h, 70% utilisation → $0.1786 per 1,000 responses."""
    cost = LocalCost(hourly_micro_usd=3_600_000, utilisation_percent=70, decode_tokens_per_s=2_400,
                     prefill_tokens_per_s=None, measured_at=None)
    price = cost.price(Provider(name="local"), MODEL, timezone.now())
    thousand_responses = price.cost_micro_usd(prompt_tokens=0, completion_tokens=300 * 1_000)
    assert round(thousand_responses / 1_000_000, 4) == 0.1786
    # The same figure as the cost model's page computes it, in floating point.
    machine = costmodel.SelfHosted(hourly_usd=3.60, utilisation=0.70, decode_tokens_per_s=2_400)
    assert round(machine.usd_per_1000_responses(300), 4) == 0.1786
    # One response at a time is rounded up to a whole micro-dollar: a ceiling never under-counts.
    assert 1_000 * price.cost_micro_usd(0, 300) >= thousand_responses


def test_the_price_per_million_is_exact_and_rounded_up():
    assert per_million_micro_usd(3_600_000, 70, 2_400) == 595_239  # 595,238.095… µ$
    assert per_million_micro_usd(3_600_000, 100, 1_000) == 1_000_000  # $1 per million, no float noise
    assert per_million_micro_usd(1, 1, 1_000_000) == 1  # never rounded down to free


def test_prompt_tokens_are_priced_from_the_prefill_rate_and_cached_ones_are_free(local):
    local.hourly_cost_micro_usd = 3_600_000
    price = LocalCost.of(local).price(local, MODEL, timezone.now())
    assert price.input_per_million_micro_usd == per_million_micro_usd(3_600_000, 70, 24_000) == 59_524
    assert price.cached_input_per_million_micro_usd == 0
    assert price.cost_micro_usd(1_000, 0, cached_tokens=1_000) == 0


def test_without_an_hourly_cost_or_a_throughput_there_is_no_price(local):
    assert LocalCost.of(local) is None  # no hourly cost
    local.hourly_cost_micro_usd = 3_600_000
    local.decode_tokens_per_s = None
    assert LocalCost.of(local) is None
    assert do_price_local_tokens(None, local, MODEL) is None and not local_prices()
    remote = Provider(name="remote", kind=Provider.Kind.OPENAI_COMPATIBLE, hourly_cost_micro_usd=1, decode_tokens_per_s=1)
    assert LocalCost.of(remote) is None


# --- staff change the hourly cost ----------------------------------------------------------------


def test_staff_setting_the_hourly_cost_derive_a_measured_price_with_its_audit(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    response = staff_client.post(url, provider_data(local, hourly_cost_usd="3.60", utilisation_percent="70"))
    assert response.status_code == 302
    [price] = local_prices()
    assert (price.output_per_million_micro_usd, price.input_per_million_micro_usd) == (595_239, 59_524)
    assert price.model == MODEL and price.basis.startswith("$3.60/h at 70% utilisation; 2,400 decode tok/s")
    trail = set(AuditEntry.objects.values_list("target", "field", "before", "after"))
    assert ("provider local", "hourly_cost", "none", "$3.60") in trail
    assert (f"price local/{MODEL}", "output_per_million", "", "$0.595239") in trail
    page = staff_client.get(url).content.decode()
    assert "$0.595239</strong> per million output tokens" in page and "measured by the workers" in page


def test_a_new_hourly_cost_adds_a_price_and_keeps_the_old_one(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    staff_client.post(url, provider_data(local, hourly_cost_usd="3.60"))
    staff_client.post(url, provider_data(local, hourly_cost_usd="7.20"))
    old, new = local_prices()
    assert new.output_per_million_micro_usd == 1_190_477 and old.output_per_million_micro_usd == 595_239
    # Saving the same figures again derives nothing new.
    staff_client.post(url, provider_data(local, hourly_cost_usd="7.20"))
    assert len(local_prices()) == 2


def test_a_new_utilisation_re_derives_the_price(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    staff_client.post(url, provider_data(local, hourly_cost_usd="3.60", utilisation_percent="70"))
    staff_client.post(url, provider_data(local, hourly_cost_usd="3.60", utilisation_percent="35"))
    assert [p.output_per_million_micro_usd for p in local_prices()] == [595_239, 1_190_477]
    assert ("provider local", "utilisation_percent", "70", "35") in set(
        AuditEntry.objects.values_list("target", "field", "before", "after"))


@pytest.mark.parametrize(
    "changes, error",
    [({"hourly_cost_usd": "-1"}, "cannot be negative"), ({"utilisation_percent": "0"}, "greater than or equal to 1"),
     ({"utilisation_percent": "101"}, "less than or equal to 100")],
    ids=["negative-cost", "zero-utilisation", "over-100"],
)
def test_nonsense_costs_are_refused_and_change_nothing(staff_client, local, changes, error):
    url = reverse("staff-provider", args=[local.pk])
    response = staff_client.post(url, provider_data(local, **{"hourly_cost_usd": "3.60", **changes}))
    assert response.status_code == 200 and error in response.content.decode()
    local.refresh_from_db()
    assert local.hourly_cost_micro_usd is None and local.utilisation_percent == 70
    assert not local_prices() and not AuditEntry.objects.exists()


def test_a_remote_provider_cannot_have_an_hourly_cost(staff_client):
    remote = Provider.objects.create(name="remote", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://x.example/v1")
    url = reverse("staff-provider", args=[remote.pk])
    response = staff_client.post(url, provider_data(remote, hourly_cost_usd="3.60", base_url="http://x.example/v1"))
    assert "Only a local provider runs on a machine of ours" in response.content.decode()
    remote.refresh_from_db()
    assert remote.hourly_cost_micro_usd is None and not local_prices()


def test_the_page_says_when_no_throughput_is_measured_yet(staff_client):
    provider = Provider.default()
    page = staff_client.get(reverse("staff-provider", args=[provider.pk])).content.decode()
    assert "No throughput measured yet" in page


# --- the workers measure -------------------------------------------------------------------------


def test_the_first_measurement_replaces_an_assumed_throughput():
    provider = Provider.default()
    Provider.objects.filter(pk=provider.pk).update(hourly_cost_micro_usd=100_000, decode_tokens_per_s=79.0,
                                                   prefill_tokens_per_s=350.0)  # assumed: no measured_at
    [price] = do_record_throughput(40.0, 200.0, model=MODEL)
    provider.refresh_from_db()
    assert (provider.decode_tokens_per_s, provider.prefill_tokens_per_s) == (40.0, 200.0)
    assert provider.throughput_measured_at is not None
    assert price.output_per_million_micro_usd == per_million_micro_usd(100_000, 70, 40.0)
    assert "measured by the workers" in price.basis


def test_only_a_rate_5_percent_above_the_best_one_is_recorded(local):
    Provider.objects.filter(pk=local.pk).update(hourly_cost_micro_usd=3_600_000)
    measured_at = Provider.objects.get(pk=local.pk).throughput_measured_at
    assert do_record_throughput(1_200.0, 12_000.0, model=MODEL) == []  # a quiet restarted worker
    assert do_record_throughput(2_450.0, 24_500.0, model=MODEL) == []  # +2%: noise
    local.refresh_from_db()
    assert (local.decode_tokens_per_s, local.throughput_measured_at) == (2_400.0, measured_at)
    [price] = do_record_throughput(3_000.0, 20_000.0, model=MODEL)
    local.refresh_from_db()
    assert (local.decode_tokens_per_s, local.prefill_tokens_per_s) == (3_000.0, 24_000.0)  # best of each
    assert price.output_per_million_micro_usd == per_million_micro_usd(3_600_000, 70, 3_000)


def test_an_engine_that_generated_nothing_records_nothing(local):
    assert do_record_throughput(0.0, 0.0, model=MODEL) == []
    local.refresh_from_db()
    assert local.decode_tokens_per_s == 2_400.0


def test_a_measurement_without_an_hourly_cost_is_kept_but_prices_nothing():
    provider = Provider.default()
    assert do_record_throughput(100.0, 500.0, model=MODEL) == []
    provider.refresh_from_db()
    assert provider.decode_tokens_per_s == 100.0 and not local_prices()


# --- local spend counts like a hosted price ------------------------------------------------------


@pytest.fixture
def priced_local(local) -> ModelPrice:
    local.hourly_cost_micro_usd = 3_600_000
    local.save()
    return do_price_local_tokens(None, local, MODEL, at=timezone.now() - timedelta(seconds=1))


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


def chat(user, feature, prompt: int, max_tokens: int):
    return admit(AdmissionRequest(uuid.uuid4().hex, user, feature, MODEL, prompt, max_tokens))


def finish(decision, completion_tokens: int) -> TokenLog:
    row = TokenLog.objects.get(request_id=decision.request_id)
    do_record_usage(row.request_id, status=TokenLog.Status.OK, usage=Usage(row.prompt_tokens, completion_tokens))
    row.refresh_from_db()
    settle(row)
    return row


def test_local_tokens_are_costed_at_the_measured_price(alice, chat_feature, priced_local):
    row = finish(chat(alice, chat_feature, prompt=1_000, max_tokens=300), 300)
    assert row.price == priced_local and row.provider.name == "local"
    assert row.cost_micro_usd == priced_local.cost_micro_usd(1_000, 300) == 60 + 179


def test_a_users_cost_cap_refuses_local_tokens(alice, chat_feature, priced_local):
    Quota.objects.create(user=alice, period="month", max_cost_micro_usd=500)
    finish(chat(alice, chat_feature, prompt=1_000, max_tokens=300), 300)  # 239 µ$
    finish(chat(alice, chat_feature, prompt=1_000, max_tokens=300), 300)  # 478 µ$
    refused = chat(alice, chat_feature, prompt=1_000, max_tokens=300)
    assert not refused.admitted and refused.code == "user_cost_per_month"


def test_the_local_providers_monthly_limit_refuses_local_tokens(alice, chat_feature, priced_local):
    Provider.objects.filter(name="local").update(monthly_limit_micro_usd=300)
    finish(chat(alice, chat_feature, prompt=1_000, max_tokens=300), 300)  # 239 of 300 µ$
    refused = chat(alice, chat_feature, prompt=2_000, max_tokens=300)  # the prompt alone costs 120 µ$
    assert not refused.admitted and refused.code == "provider_spend" and "'local'" in refused.message


# --- each weight variant priced by its own throughput ----------------------------------------------

INT8_MODEL = f"{MODEL}@int8"


def test_a_feature_on_int8_is_logged_as_the_int8_model_and_priced_as_full_precision_until_it_has_its_own(
    alice, chat_feature, priced_local
):
    from inference.web.tokenizer import model_name

    chat_feature.quantization = "int8"
    chat_feature.save()
    assert model_name(chat_feature) == INT8_MODEL
    row = finish(admit(AdmissionRequest(uuid.uuid4().hex, alice, chat_feature, model_name(chat_feature), 1_000, 300)), 300)
    assert row.model == INT8_MODEL and row.price == priced_local  # no price of its own yet: never free


def test_an_int8_worker_prices_int8_tokens_from_its_own_rates_and_leaves_full_precision_alone(local, priced_local):
    from budgets.actions import do_record_variant_throughput

    Provider.objects.filter(pk=local.pk).update(hourly_cost_micro_usd=3_600_000)
    [price] = do_record_variant_throughput(4_800.0, 30_000.0, model=INT8_MODEL)
    assert price.model == INT8_MODEL and price.source == ModelPrice.Source.MEASURED
    assert price.output_per_million_micro_usd == per_million_micro_usd(3_600_000, 70, 4_800) < priced_local.output_per_million_micro_usd
    assert price.input_per_million_micro_usd == per_million_micro_usd(3_600_000, 70, 30_000)
    local.refresh_from_db()
    assert local.decode_tokens_per_s == 2_400.0  # the provider's rates are full precision's
    assert ModelPrice.objects.filter(model=MODEL).get() == priced_local
    # Slower, or under 5% faster: nothing new; 5% faster: a new price.
    assert do_record_variant_throughput(2_000.0, 30_000.0, model=INT8_MODEL) == []
    assert do_record_variant_throughput(4_900.0, 30_000.0, model=INT8_MODEL) == []
    [faster] = do_record_variant_throughput(5_100.0, 30_000.0, model=INT8_MODEL)
    assert faster.output_per_million_micro_usd == per_million_micro_usd(3_600_000, 70, 5_100)


def test_a_new_hourly_cost_re_prices_a_variant_at_its_next_report(local, priced_local):
    from budgets.actions import do_record_variant_throughput

    Provider.objects.filter(pk=local.pk).update(hourly_cost_micro_usd=3_600_000)
    do_record_variant_throughput(4_800.0, 30_000.0, model=INT8_MODEL)
    Provider.objects.filter(pk=local.pk).update(hourly_cost_micro_usd=7_200_000)
    [dearer] = do_record_variant_throughput(4_800.0, 30_000.0, model=INT8_MODEL)
    assert dearer.output_per_million_micro_usd == per_million_micro_usd(7_200_000, 70, 4_800)


def test_a_variant_price_staff_set_stands_against_measurements(local, alice, chat_feature, priced_local):
    from budgets.actions import do_record_variant_throughput

    Provider.objects.filter(pk=local.pk).update(hourly_cost_micro_usd=3_600_000)
    explicit = ModelPrice.objects.create(provider=local, model=INT8_MODEL, input_per_million_micro_usd=1,
                                         output_per_million_micro_usd=2, effective_from=timezone.now() - timedelta(seconds=1))
    assert do_record_variant_throughput(9_000.0, 90_000.0, model=INT8_MODEL) == []
    chat_feature.quantization = "int8"
    chat_feature.save()
    row = finish(chat(alice, chat_feature, prompt=1_000, max_tokens=300), 300)
    assert row.price == priced_local  # chat() logs the bare model: full precision's price
    row = finish(admit(AdmissionRequest(uuid.uuid4().hex, alice, chat_feature, INT8_MODEL, 1_000, 300)), 300)
    assert row.price == explicit and row.cost_micro_usd == explicit.cost_micro_usd(1_000, 300)


def test_staff_price_a_variant_by_its_name_without_marking_it_new(staff_client, local):
    url = reverse("staff-provider", args=[local.pk])
    data = {"form": "price", "model": INT8_MODEL, "input_usd": "0.01", "output_usd": "0.02", "cached_input_usd": "",
            "effective_from": ""}
    assert staff_client.post(url, data).status_code == 302
    price = ModelPrice.objects.get(model=INT8_MODEL)
    assert (price.source, price.output_per_million_micro_usd) == (ModelPrice.Source.STAFF, 20_000)
