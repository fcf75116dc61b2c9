"""The cost model: what a feature costs per user per month, before anyone builds it.

Cost per request is arithmetic; cost per *user* is a distribution, because requests per user are
long-tailed. So this samples users (fixed seed: the same inputs give the same answer), gives each a
daily request rate from a long-tailed distribution, draws their month of requests with prompt and
output lengths from their own distributions, and prices every token.

Plain typed functions, no Django: budgets/views and the `costmodel` command feed them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

DAYS_PER_MONTH = 30
MAX_SIMULATED_USERS = 20_000
MAX_SAMPLED_REQUESTS = 2_000_000


class CostModelError(ValueError):
    """Inputs that make no sense; the message says which and why."""


# --- distributions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    """fixed(value) · lognormal(median, sigma) · pareto(minimum, alpha) · empirical(values)."""

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    minimum: float = 0.0
    alpha: float = 0.0
    values: tuple[float, ...] = ()

    @classmethod
    def fixed(cls, value: float) -> Distribution:
        return cls("fixed", median=value)

    @classmethod
    def lognormal(cls, median: float, sigma: float) -> Distribution:
        return cls("lognormal", median=median, sigma=sigma)

    @classmethod
    def pareto(cls, minimum: float, alpha: float) -> Distribution:
        return cls("pareto", minimum=minimum, alpha=alpha)

    @classmethod
    def empirical(cls, values) -> Distribution:
        return cls("empirical", values=tuple(float(v) for v in values))

    def validate(self, name: str) -> None:
        if self.kind == "fixed" and self.median < 0:
            raise CostModelError(f"{name}: a fixed value cannot be negative ({self.median}).")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise CostModelError(f"{name}: a lognormal needs a median above 0 and a sigma of 0 or more.")
        if self.kind == "pareto" and (self.minimum <= 0 or self.alpha <= 1):
            raise CostModelError(f"{name}: a power law needs a minimum above 0 and alpha above 1 (else the mean is infinite).")
        if self.kind == "empirical" and (not self.values or min(self.values) < 0):
            raise CostModelError(f"{name}: the observed values are empty or negative.")
        if self.kind not in ("fixed", "lognormal", "pareto", "empirical"):
            raise CostModelError(f"{name}: unknown distribution {self.kind!r}.")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(size, self.median, dtype=float)
        if self.kind == "lognormal":
            return rng.lognormal(math.log(self.median), self.sigma, size)
        if self.kind == "pareto":
            return self.minimum * (1 + rng.pareto(self.alpha, size))
        return rng.choice(np.asarray(self.values), size)

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.median
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        if self.kind == "pareto":
            return self.alpha * self.minimum / (self.alpha - 1)
        return float(np.mean(self.values))

    @classmethod
    def fit_lognormal(cls, values) -> Distribution:
        """Median and sigma of log(values): the maximum-likelihood lognormal of observed data."""
        data = np.asarray([v for v in values if v > 0], dtype=float)
        if data.size == 0:
            raise CostModelError("no positive observations to fit")
        logs = np.log(data)
        return cls.lognormal(float(math.exp(logs.mean())), float(logs.std()))


# --- prices and the machine --------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    input_per_million_usd: float
    output_per_million_usd: float
    label: str = ""


@dataclass(frozen=True)
class SelfHosted:
    """A machine you pay by the hour, serving at some utilisation with a measured decode rate."""

    hourly_usd: float
    utilisation: float
    decode_tokens_per_s: float

    def validate(self) -> None:
        if self.hourly_usd < 0:
            raise CostModelError("The hourly cost of the machine cannot be negative.")
        if not 0 < self.utilisation <= 1:
            raise CostModelError(f"Utilisation must be above 0% and at most 100% (got {self.utilisation:.0%}).")
        if self.decode_tokens_per_s <= 0:
            raise CostModelError("The decode rate must be above 0 tokens/s.")

    def responses_per_s(self, output_tokens: float) -> float:
        return self.decode_tokens_per_s * self.utilisation / output_tokens

    def usd_per_1000_responses(self, output_tokens: float) -> float:
        return self.hourly_usd / (self.responses_per_s(output_tokens) * 3600) * 1000

    def usd_per_million_tokens(self) -> float:
        return self.hourly_usd / (self.decode_tokens_per_s * self.utilisation * 3600) * 1_000_000

    def as_price(self) -> Price:
        # Decode is what the machine sells; prefill rides along (it is far faster per token).
        return Price(0.0, self.usd_per_million_tokens(), "self-hosted")


# --- latency ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyModel:
    overhead_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    retrieval_ms: float = 0.0

    def breakdown_ms(self, input_tokens: float, output_tokens: float) -> dict[str, float]:
        return {
            "retrieval": self.retrieval_ms,
            "overhead": self.overhead_ms,
            "prefill": input_tokens / self.prefill_tokens_per_s * 1000,
            "decode": output_tokens / self.decode_tokens_per_s * 1000,
        }

    def total_ms(self, input_tokens: float, output_tokens: float) -> float:
        return sum(self.breakdown_ms(input_tokens, output_tokens).values())


def latency_shares(parts: dict[str, float]) -> dict[str, float]:
    """Each part's share of the whole: {retrieval 2 s, prefill 1 s, decode 4 s} → 2/7, 1/7, 4/7."""
    total = sum(parts.values())
    return {name: (value / total if total else 0.0) for name, value in parts.items()}


# --- the model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    system_prompt_tokens: Distribution
    retrieved_tokens: Distribution
    user_prompt_tokens: Distribution
    output_tokens: Distribution
    requests_per_user_per_day: Distribution
    users: int
    price: Price
    latency: LatencyModel
    target_usd_per_user_month: float
    seed: int = 7

    def validate(self) -> None:
        for name in ("system_prompt_tokens", "retrieved_tokens", "user_prompt_tokens", "output_tokens", "requests_per_user_per_day"):
            getattr(self, name).validate(name.replace("_", " "))
        if self.users < 1:
            raise CostModelError("The number of users must be at least 1.")
        if self.price.input_per_million_usd < 0 or self.price.output_per_million_usd < 0:
            raise CostModelError("Prices cannot be negative.")
        if self.target_usd_per_user_month <= 0:
            raise CostModelError("The target price per user must be above $0.")
        if self.latency.prefill_tokens_per_s <= 0 or self.latency.decode_tokens_per_s <= 0:
            raise CostModelError("Prefill and decode rates must be above 0 tokens/s.")


@dataclass
class Result:
    users: int
    simulated_users: int
    per_user_month_usd: dict[str, float]  # mean, p50, p90, p99, max
    total_month_usd: float
    top1_share: float
    per_request_usd: dict[str, float]  # prompt, output, total (means)
    mean_input_tokens: float
    mean_output_tokens: float
    latency_ms: dict[str, float]
    latency_shares: dict[str, float]
    latency_total_ms: float
    losing_share: float
    verdict: str
    controls: list[dict] = field(default_factory=list)
    histogram: dict = field(default_factory=dict)
    cost_vs_prompt: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Sample:
    user_rates: np.ndarray  # requests per day per simulated user
    user_of_request: np.ndarray  # index of the user of each sampled request
    input_tokens: np.ndarray
    output_tokens: np.ndarray


def run(inputs: Inputs) -> Result:
    inputs.validate()
    sample = _simulate(inputs)
    per_user = _per_user_cost(inputs, sample)
    prompt_cost = sample.input_tokens * inputs.price.input_per_million_usd / 1e6
    output_cost = sample.output_tokens * inputs.price.output_per_million_usd / 1e6
    scale = inputs.users / len(per_user)
    mean_in, mean_out = float(sample.input_tokens.mean()), float(sample.output_tokens.mean())
    latency = inputs.latency.breakdown_ms(mean_in, mean_out)
    losing = float((per_user > inputs.target_usd_per_user_month).mean())
    result = Result(
        users=inputs.users,
        simulated_users=len(per_user),
        per_user_month_usd=_summary(per_user),
        total_month_usd=float(per_user.sum() * scale),
        top1_share=top_share(per_user, 0.01),
        per_request_usd={"prompt": float(prompt_cost.mean()), "output": float(output_cost.mean()),
                         "total": float((prompt_cost + output_cost).mean())},
        mean_input_tokens=mean_in,
        mean_output_tokens=mean_out,
        latency_ms=latency,
        latency_shares=latency_shares(latency),
        latency_total_ms=sum(latency.values()),
        losing_share=losing,
        verdict=verdict(inputs.target_usd_per_user_month, losing),
        histogram=_histogram(per_user),
        cost_vs_prompt=_cost_vs_prompt(sample, prompt_cost + output_cost),
    )
    result.controls = tail_controls(inputs, sample, per_user)
    return result


def _simulate(inputs: Inputs) -> _Sample:
    rng = np.random.default_rng(inputs.seed)
    simulated = min(inputs.users, MAX_SIMULATED_USERS)
    rates = inputs.requests_per_user_per_day.sample(rng, simulated)
    counts = rng.poisson(np.maximum(rates, 0) * DAYS_PER_MONTH)
    if counts.sum() > MAX_SAMPLED_REQUESTS:
        # Keep memory bounded by simulating fewer users (users are independent, so a prefix is a
        # random sample); each kept user keeps their whole month, so per-user costs stay true.
        keep = max(1, int(np.searchsorted(np.cumsum(counts), MAX_SAMPLED_REQUESTS)))
        rates, counts = rates[:keep], counts[:keep]
    n = int(counts.sum())
    user_of_request = np.repeat(np.arange(len(counts)), counts)
    input_tokens = (
        inputs.system_prompt_tokens.sample(rng, n) + inputs.retrieved_tokens.sample(rng, n)
        + inputs.user_prompt_tokens.sample(rng, n)
    ).round()
    output_tokens = inputs.output_tokens.sample(rng, n).round()
    return _Sample(rates, user_of_request, input_tokens, output_tokens)


def _per_user_cost(inputs: Inputs, sample: _Sample, input_cap: float | None = None,
                   output_cap: float | None = None, daily_cap: float | None = None) -> np.ndarray:
    """Monthly cost of each simulated user, optionally with one control applied."""
    input_tokens = sample.input_tokens if input_cap is None else np.minimum(sample.input_tokens, input_cap)
    output_tokens = sample.output_tokens if output_cap is None else np.minimum(sample.output_tokens, output_cap)
    cost = (input_tokens * inputs.price.input_per_million_usd + output_tokens * inputs.price.output_per_million_usd) / 1e6
    per_user = np.bincount(sample.user_of_request, weights=cost, minlength=len(sample.user_rates))
    if daily_cap is not None:
        # A requests-per-day cap keeps at most cap × 30 of a user's requests in a month.
        counts = np.bincount(sample.user_of_request, minlength=len(sample.user_rates))
        kept = np.minimum(counts, daily_cap * DAYS_PER_MONTH)
        per_user = np.where(counts > 0, per_user * kept / np.maximum(counts, 1), 0.0)
    return per_user


def _summary(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def top_share(values: np.ndarray, fraction: float) -> float:
    """Share of the total from the heaviest `fraction` of users (at least one user)."""
    total = float(values.sum())
    if total <= 0:
        return 0.0
    count = max(1, int(math.ceil(len(values) * fraction)))
    return float(np.sort(values)[-count:].sum() / total)


def verdict(target: float, losing_share: float) -> str:
    if losing_share == 0:
        return f"At ${target:,.2f}/user/month the feature makes money on every user."
    percent = losing_share * 100
    shown = f"{percent:.0f}%" if percent >= 1 else f"{percent:.1f}%"
    return f"At ${target:,.2f}/user/month the feature loses money for the top {shown} of users."


def tail_controls(inputs: Inputs, sample: _Sample, per_user: np.ndarray) -> list[dict]:
    """For each control that can cap the tail: the loosest cap that brings p99 under the target."""
    target = inputs.target_usd_per_user_month
    p99 = float(np.percentile(per_user, 99))
    controls = [{
        "control": "monthly cost cap per user",
        "cap": f"${target:,.2f} per user per month",
        "p99_usd": min(p99, target),
        "works": True,
        "note": "a hard cost cap always holds the line; users past it are refused with a clear message",
    }]
    controls.append(_search_cap(
        "requests per user per day", lambda cap: _per_user_cost(inputs, sample, daily_cap=cap),
        upper=float(max(1.0, np.percentile(sample.user_rates, 100) * 2)), target=target, unit="requests/day", integer=True,
    ))
    controls.append(_search_cap(
        "maximum output tokens per call", lambda cap: _per_user_cost(inputs, sample, output_cap=cap),
        upper=float(max(1.0, sample.output_tokens.max() if sample.output_tokens.size else 1)), target=target, unit="tokens", integer=True,
    ))
    controls.append(_search_cap(
        "maximum input tokens per call", lambda cap: _per_user_cost(inputs, sample, input_cap=cap),
        upper=float(max(1.0, sample.input_tokens.max() if sample.input_tokens.size else 1)), target=target, unit="tokens", integer=True,
    ))
    controls.append({
        "control": "loop budget", "cap": "max calls and spend per loop", "p99_usd": p99, "works": False,
        "note": "only matters for features that call the model more than once per request",
    })
    return controls


def _search_cap(name: str, cost_with_cap, *, upper: float, target: float, unit: str, integer: bool) -> dict:
    """Bisection for the largest cap whose p99 monthly cost per user is at or under the target."""
    def p99(cap: float) -> float:
        return float(np.percentile(cost_with_cap(cap), 99))

    if p99(upper) <= target:
        return {"control": name, "cap": "not needed", "p99_usd": p99(upper), "works": True, "note": "p99 is already under the target"}
    low, high = (1.0 if integer else 0.0), upper
    if p99(low) > target:
        return {"control": name, "cap": f"even 1 {unit} leaves p99 above target", "p99_usd": p99(low), "works": False,
                "note": "this control alone cannot cap the tail"}
    for _ in range(40):
        middle = (low + high) / 2
        if p99(middle) <= target:
            low = middle
        else:
            high = middle
        if integer and high - low < 1:
            break
    cap = math.floor(low) if integer else low
    return {"control": name, "cap": f"{cap:,} {unit}", "cap_value": cap, "p99_usd": p99(cap), "works": True, "note": ""}


def _histogram(per_user: np.ndarray, bins: int = 40) -> dict:
    counts, edges = np.histogram(per_user, bins=bins)
    return {"counts": counts.tolist(), "edges": edges.tolist(), "percentiles": _summary(per_user)}


def _cost_vs_prompt(sample: _Sample, cost: np.ndarray, points: int = 2000) -> dict:
    if not cost.size:
        return {"prompt_tokens": [], "cost_usd": []}
    step = max(1, cost.size // points)
    return {"prompt_tokens": sample.input_tokens[::step].tolist(), "cost_usd": cost[::step].tolist()}
