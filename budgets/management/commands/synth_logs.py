"""`manage.py synth_logs [--rows N] [--users N] [--days N] [--seed S] [--clear]`

Realistic synthetic TokenLog rows for demos and load tests: a long tail of users (a few heavy users
make most requests), lognormal prompt and completion sizes per feature, a daily and weekly cycle,
mostly ok requests with some cancelled, failed and refused ones (refusals mostly hit heavy users).
The same seed gives the same rows (users, features, sizes, statuses, costs); only their timestamps
move with the time the command runs, since they spread over the last N days.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.core.management.base import CommandError
from django.utils import timezone

from accounts.management.database import DatabaseCommand
from budgets.guard import price_in_force
from budgets.models import Feature, ModelPrice, Provider, TokenLog
from budgets.periods import local_zone

PREFIX = "synth-"
BATCH = 5_000
MAX_ROWS = 20_000_000
DEFAULT_ROWS = 100_000
# Used when the default provider has no price for the model: $0.15 / $0.60 per million tokens.
FALLBACK_INPUT_PER_MILLION = 150_000
FALLBACK_OUTPUT_PER_MILLION = 600_000
USER_SIGMA = 1.7  # lognormal spread of per-user activity: the top 1% make about a quarter of requests


@dataclass(frozen=True)
class FeatureShape:
    name: str
    description: str
    share: float  # of all requests
    prompt_median: int
    prompt_sigma: float
    completion_median: int
    completion_sigma: float
    max_tokens: int


FEATURES = [
    FeatureShape("chat", "Chat with the model", 0.65, 350, 0.9, 180, 0.8, 512),
    FeatureShape("summary", "Summaries of long documents", 0.22, 1500, 0.7, 150, 0.5, 256),
    FeatureShape("extract", "Structured extraction", 0.13, 800, 0.8, 60, 0.7, 256),
]
STATUSES = [(TokenLog.Status.OK, 0.955), (TokenLog.Status.CANCELLED, 0.03), (TokenLog.Status.FAILED, 0.015)]
REFUSALS = [
    ("user_tokens_per_day", 0.40),
    ("user_requests_per_day", 0.20),
    ("user_cost_per_month", 0.10),
    ("feature_tokens_per_day", 0.15),
    ("max_input_tokens", 0.10),
    ("provider_spend", 0.05),
]
# Relative activity by local hour: quiet at night, a peak in the early afternoon.
HOURLY = [0.15, 0.1, 0.08, 0.08, 0.1, 0.15, 0.3, 0.55, 0.8, 0.95, 1.0, 1.0,
          0.9, 0.95, 1.0, 0.95, 0.9, 0.8, 0.65, 0.55, 0.5, 0.45, 0.35, 0.25]
WEEKEND = 0.55


class Command(DatabaseCommand):
    help = "Generate synthetic TokenLog rows (request ids start with 'synth-'); --clear removes them."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--rows", type=int, help=f"rows to create (default {DEFAULT_ROWS:,})")
        parser.add_argument("--users", type=int, default=2000, help="synthetic users synth-user-0001… (default 2000)")
        parser.add_argument("--days", type=int, default=30, help="spread over the last N days (default 30)")
        parser.add_argument("--seed", type=int, default=42, help="the same seed gives the same rows (default 42)")
        parser.add_argument("--clear", action="store_true", help="delete all synthetic rows (then generate if --rows)")

    def handle(self, *args, rows=None, users=2000, days=30, seed=42, clear=False, **options) -> None:
        _check("--rows", rows, 1, MAX_ROWS)
        _check("--users", users, 1, 1_000_000)
        _check("--days", days, 1, 3650)
        _check("--seed", seed, 0, 2**63)
        if clear:
            deleted = clear_synthetic_rows()
            self.stdout.write(f"deleted {deleted:,} synthetic rows")
            if rows is None:
                return
        rows = DEFAULT_ROWS if rows is None else rows
        if TokenLog.objects.filter(request_id__startswith=f"{PREFIX}{seed}-").exists():
            raise CommandError(f"Synthetic rows for seed {seed} already exist; add --clear, or pick another --seed.")
        self._generate(rows, users, days, seed)

    def _generate(self, rows: int, n_users: int, days: int, seed: int) -> None:
        rng = random.Random(seed)
        now = timezone.now()
        user_ids = synthetic_users(n_users)
        features = {shape.name: _feature(shape) for shape in FEATURES}
        provider = Provider.default()
        price = price_in_force(provider, settings.CEILING_MODEL_NAME, now)
        maker = RowMaker(rng, user_ids, features, provider, price, seed)
        price_text = f"{price}" if price else "fixed $0.15 / $0.60 per million tokens"
        self.stdout.write(f"generating {rows:,} rows for {n_users:,} users over {days} days, seed {seed}, {price_text}")
        started = time.monotonic()
        # Times get a stream of their own: how many draws the rejection sampling takes depends on
        # `now`, and must not shift the draws of users, sizes and statuses (same seed, same rows).
        stamps = timestamps(random.Random(f"{seed}-times"), rows, days, now)
        created = 0
        last_report = started
        for first in range(0, rows, BATCH):
            batch = [maker.row(n, stamps[n]) for n in range(first, min(rows, first + BATCH))]
            TokenLog.objects.bulk_create(batch, batch_size=BATCH)
            created += len(batch)
            if time.monotonic() - last_report >= 2 or created == rows:
                last_report = time.monotonic()
                rate = created / max(1e-6, last_report - started)
                self.stdout.write(f"  {created:,} / {rows:,} rows ({rate:,.0f} rows/s)")
        elapsed = time.monotonic() - started
        self.stdout.write(self.style.SUCCESS(
            f"created {created:,} rows in {elapsed:.1f} s ({created / max(elapsed, 1e-6):,.0f} rows/s)"
        ))


def _check(flag: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise CommandError(f"{flag} must be between {low:,} and {high:,}, not {value:,}.")


def clear_synthetic_rows() -> int:
    """Delete in chunks through the ORM, so rows that point at a log (transcripts) go with it,
    without loading a million rows into memory at once."""
    synthetic = TokenLog.objects.filter(request_id__startswith=PREFIX)
    deleted = 0
    while True:
        ids = list(synthetic.order_by("pk").values_list("pk", flat=True)[:BATCH])
        if not ids:
            return deleted
        _, per_model = TokenLog.objects.filter(pk__in=ids).only("pk").delete()
        deleted += per_model.get(TokenLog._meta.label, 0)


def synthetic_users(n: int) -> list[int]:
    """Ids of synth-user-0001 … synth-user-N, creating the missing ones (they cannot log in)."""
    User = get_user_model()
    names = [f"synth-user-{i:04d}" for i in range(1, n + 1)]
    existing = set(User.objects.filter(username__in=names).values_list("username", flat=True))
    missing = [User(username=name, password=make_password(None)) for name in names if name not in existing]
    User.objects.bulk_create(missing, batch_size=BATCH, ignore_conflicts=True)
    ids = dict(User.objects.filter(username__in=names).values_list("username", "id"))
    return [ids[name] for name in names]


def _feature(shape: FeatureShape) -> Feature:
    feature, _ = Feature.objects.get_or_create(name=shape.name, defaults={"description": shape.description})
    return feature


def timestamps(rng: random.Random, rows: int, days: int, now: datetime) -> list[datetime]:
    """Sorted times in (now - days, now], shaped by the hour of day and the weekend.

    Rejection sampling: uniform instants kept with probability activity(local hour, weekday);
    rows are then numbered in time order, as a real ledger's would be.
    """
    zone = local_zone()
    span = days * 86_400
    offset = now.astimezone(zone).utcoffset() or timedelta(0)  # one offset: a DST hour off is fine here
    epoch_now = now.timestamp()
    shift = offset.total_seconds()
    found: list[float] = []
    while len(found) < rows:
        t = epoch_now - rng.random() * span
        local = t + shift
        hour = int(local // 3600) % 24
        weekday = (int(local // 86_400) + 3) % 7  # 1970-01-01 was a Thursday (3)
        weight = HOURLY[hour] * (WEEKEND if weekday >= 5 else 1.0)
        if rng.random() < weight:
            found.append(t)
    found.sort()
    base = datetime.fromtimestamp(0, tz=now.tzinfo)
    return [base + timedelta(seconds=t) for t in found]


class RowMaker:
    """Draws one TokenLog row at a time from the seeded generator (so batches need no memory)."""

    def __init__(self, rng: random.Random, user_ids: list[int], features: dict[str, Feature],
                 provider: Provider, price: ModelPrice | None, seed: int) -> None:
        self.rng = rng
        self.user_ids = user_ids
        weights = [rng.lognormvariate(0.0, USER_SIGMA) for _ in user_ids]
        mean = sum(weights) / len(weights)
        self.user_cum = list(_cumulative(weights))
        # Heavy users hit their caps: refusal odds grow with activity (1% for a median user, at most 8%).
        self.refusal_odds = [min(0.08, 0.04 * w / mean) for w in weights]
        self.shapes = FEATURES
        self.shape_cum = list(_cumulative([s.share for s in FEATURES]))
        self.features = features
        self.provider = provider
        self.price = price
        # An unsaved price carries the same rounding rule as a real one.
        self.cost_price = price or ModelPrice(
            input_per_million_micro_usd=FALLBACK_INPUT_PER_MILLION,
            output_per_million_micro_usd=FALLBACK_OUTPUT_PER_MILLION,
        )
        self.status_cum = list(_cumulative([w for _, w in STATUSES]))
        self.refusal_cum = list(_cumulative([w for _, w in REFUSALS]))
        self.model = settings.CEILING_MODEL_NAME
        self.prefix = f"{PREFIX}{seed}-"

    def row(self, n: int, created_at: datetime) -> TokenLog:
        rng = self.rng
        user_index = rng.choices(range(len(self.user_ids)), cum_weights=self.user_cum)[0]
        shape = rng.choices(self.shapes, cum_weights=self.shape_cum)[0]
        prompt = _lognormal_int(rng, shape.prompt_median, shape.prompt_sigma, 1, 8000)
        wanted = _lognormal_int(rng, shape.completion_median, shape.completion_sigma, 1, 4 * shape.max_tokens)
        completion = min(wanted, shape.max_tokens)
        row = TokenLog(
            request_id=f"{self.prefix}{n}",
            user_id=self.user_ids[user_index],
            feature=self.features[shape.name],
            provider=self.provider,
            price=self.price,
            model=self.model,
            prompt_tokens=prompt,
            max_tokens=shape.max_tokens,
            created_at=created_at,
        )
        if rng.random() < self.refusal_odds[user_index]:
            return self._refused(row)
        status = rng.choices(STATUSES, cum_weights=self.status_cum)[0][0]
        ttft = int(40 + prompt * 0.08 + rng.lognormvariate(math.log(120), 0.5))
        per_token_ms = rng.lognormvariate(math.log(22), 0.3)
        if status == TokenLog.Status.CANCELLED:
            completion = max(1, int(completion * rng.uniform(0.05, 0.9)))
            row.finish_reason = "cancelled"
        elif status == TokenLog.Status.FAILED:
            completion = int(completion * rng.uniform(0.0, 0.5))
            row.error = "engine error (synthetic)"
            ttft = ttft if completion else None
        else:
            row.finish_reason = "length" if wanted >= shape.max_tokens else "stop"
        total = (ttft or int(rng.lognormvariate(math.log(800), 0.8))) + int(completion * per_token_ms)
        row.status = status
        row.admitted = True
        row.completion_tokens = completion
        row.cost_micro_usd = self.cost_price.cost_micro_usd(prompt, completion)
        row.ttft_ms = ttft
        row.total_ms = total
        row.finished_at = created_at + timedelta(milliseconds=total)
        return row

    def _refused(self, row: TokenLog) -> TokenLog:
        code = self.rng.choices(REFUSALS, cum_weights=self.refusal_cum)[0][0]
        row.status = TokenLog.Status.REFUSED
        row.refusal_code = code
        row.error = f"Refused: {code.replace('_', ' ')} (synthetic)."
        row.max_tokens = 0
        row.finished_at = row.created_at
        return row


def _cumulative(weights: list[float]):
    running = 0.0
    for weight in weights:
        running += weight
        yield running


def _lognormal_int(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, int(rng.lognormvariate(math.log(median), sigma))))
