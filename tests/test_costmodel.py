"""The cost model's formulas against hand-computed values, and its sampling against known laws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from budgets.costmodel import (
    CostModelError,
    Distribution,
    Inputs,
    LatencyModel,
    Price,
    SelfHosted,
    latency_shares,
    run,
    top_share,
    verdict,
)


def test_latency_of_2000_in_300_out_is_2630_ms():
    model = LatencyModel(overhead_ms=80, prefill_tokens_per_s=40_000, decode_tokens_per_s=120)
    assert model.total_ms(2_000, 300) == pytest.approx(2_630)
    assert model.breakdown_ms(2_000, 300) == {"retrieval": 0, "overhead": 80, "prefill": 50, "decode": 2_500}


def test_self_hosted_throughput_and_price():
    machine = SelfHosted(hourly_usd=3.60, utilisation=0.70, decode_tokens_per_s=2_400)
    assert machine.responses_per_s(300) == pytest.approx(5.6)
    assert machine.usd_per_1000_responses(300) == pytest.approx(0.1786, abs=5e-5)
    assert machine.usd_per_million_tokens() == pytest.approx(3.60 / (2_400 * 0.7 * 3600) * 1e6)


def test_a_latency_trace_splits_into_shares():
    shares = latency_shares({"retrieval": 2.0, "prefill": 1.0, "decode": 4.0})
    assert shares == pytest.approx({"retrieval": 2 / 7, "prefill": 1 / 7, "decode": 4 / 7})


def test_percentiles_of_a_known_lognormal_come_out_right():
    rng = np.random.default_rng(1)
    sample = Distribution.lognormal(median=100, sigma=0.5).sample(rng, 200_000)
    assert np.percentile(sample, 50) == pytest.approx(100, rel=0.01)
    assert np.percentile(sample, 99) == pytest.approx(100 * math.exp(2.3263 * 0.5), rel=0.02)
    fitted = Distribution.fit_lognormal(sample)
    assert fitted.median == pytest.approx(100, rel=0.01) and fitted.sigma == pytest.approx(0.5, rel=0.01)


def inputs(**overrides) -> Inputs:
    base = dict(
        system_prompt_tokens=Distribution.fixed(200),
        retrieved_tokens=Distribution.fixed(0),
        user_prompt_tokens=Distribution.lognormal(100, 0.6),
        output_tokens=Distribution.lognormal(250, 0.5),
        requests_per_user_per_day=Distribution.lognormal(2, 1.2),
        users=5_000,
        price=Price(0.15, 0.60),
        latency=LatencyModel(80, 40_000, 120),
        target_usd_per_user_month=0.05,
    )
    base.update(overrides)
    return Inputs(**base)


def test_fixed_inputs_give_the_hand_computed_cost_per_user():
    result = run(inputs(
        user_prompt_tokens=Distribution.fixed(800), output_tokens=Distribution.fixed(500),
        requests_per_user_per_day=Distribution.fixed(10), users=2_000,
    ))
    per_request = (1_000 * 0.15 + 500 * 0.60) / 1e6
    assert result.per_request_usd["total"] == pytest.approx(per_request)
    assert result.per_request_usd["prompt"] == pytest.approx(1_000 * 0.15 / 1e6)
    # Poisson(300) requests a month: mean cost 300 × per request, within sampling error.
    assert result.per_user_month_usd["mean"] == pytest.approx(300 * per_request, rel=0.01)
    assert result.total_month_usd == pytest.approx(2_000 * 300 * per_request, rel=0.01)


def test_the_same_inputs_give_the_same_answer():
    assert run(inputs()).as_dict() == run(inputs()).as_dict()


def test_a_long_tail_is_reported_with_a_verdict_and_the_controls_that_cap_it():
    result = run(inputs())
    summary = result.per_user_month_usd
    assert summary["p50"] < summary["p90"] < summary["p99"] <= summary["max"]
    assert result.top1_share > 0.05  # the heaviest 1% spend far more than 1%
    assert 0 < result.losing_share < 1
    assert result.verdict.startswith("At $0.05/user/month the feature loses money for the top ")
    by_name = {c["control"]: c for c in result.controls}
    daily = by_name["requests per user per day"]
    assert daily["works"] and daily["p99_usd"] <= 0.05
    assert by_name["monthly cost cap per user"]["works"]


def test_top_share_and_verdict_wording():
    assert top_share(np.array([1.0] * 99 + [99.0]), 0.01) == pytest.approx(0.5)
    assert verdict(2, 0.07) == "At $2.00/user/month the feature loses money for the top 7% of users."
    assert verdict(2, 0) == "At $2.00/user/month the feature makes money on every user."


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"users": 0}, "at least 1"),
        ({"target_usd_per_user_month": 0}, "above \\$0"),
        ({"price": Price(-1, 1)}, "cannot be negative"),
        ({"output_tokens": Distribution.lognormal(0, 1)}, "median above 0"),
        ({"requests_per_user_per_day": Distribution.pareto(1, 1)}, "alpha above 1"),
        ({"latency": LatencyModel(0, 0, 10)}, "above 0 tokens/s"),
    ],
)
def test_nonsense_inputs_are_refused_with_a_reason(overrides, message):
    with pytest.raises(CostModelError, match=message):
        run(inputs(**overrides))


def test_utilisation_above_100_percent_is_refused():
    with pytest.raises(CostModelError, match="at most 100%"):
        SelfHosted(1, 1.5, 100).validate()
