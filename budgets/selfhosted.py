"""Self-hosted tokens, priced like a hosted model's: the machine's hourly cost ÷ the tokens it serves per hour.

    cost per token = hourly cost ÷ (tokens per second × 3600 × utilisation)

Output tokens are priced from the engine's decode rate, prompt tokens from its prefill rate, each as
if it had the machine alone: in a continuous batch they share the steps, so the sum is an upper
bound, and a ceiling never under-counts. Cached prompt tokens cost nothing: their KV blocks are
reused, not prefilled again. The rates are the highest 10-second rates a worker has reported
(inference/worker/throughput.py): what the machine has shown it can do at full load; the utilisation
then says how much of each paid hour it is expected to spend doing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

from django.utils import timezone

from .models import ModelPrice, Provider
from .money import format_usd

SECONDS_PER_HOUR = 3600
TOKENS_PER_MILLION = 1_000_000


def per_million_micro_usd(hourly_micro_usd: int, utilisation_percent: int, tokens_per_s: float) -> int:
    """Micro-dollars per million tokens, rounded up: e.g. $3.60/h, 70%, 2,400 tok/s → 595,239 ($0.595239)."""
    # Fractions, not floats: the price must not depend on how 0.7 rounds in binary.
    tokens_per_hour = Fraction(tokens_per_s) * SECONDS_PER_HOUR * Fraction(utilisation_percent, 100)
    return math.ceil(Fraction(hourly_micro_usd) * TOKENS_PER_MILLION / tokens_per_hour)


@dataclass(frozen=True)
class LocalCost:
    """What a local provider's tokens cost, from its hourly cost, utilisation and measured rates."""

    hourly_micro_usd: int
    utilisation_percent: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float | None
    measured_at: datetime | None  # None: an assumed throughput (seed_demo), no worker has reported yet

    @classmethod
    def of(cls, provider: Provider) -> LocalCost | None:
        """None while the provider has no hourly cost or no decode rate: then it cannot be derived."""
        if provider.kind != Provider.Kind.LOCAL or provider.hourly_cost_micro_usd is None:
            return None
        if not provider.decode_tokens_per_s or provider.decode_tokens_per_s <= 0:
            return None
        if not 0 < provider.utilisation_percent <= 100:
            return None
        return cls(provider.hourly_cost_micro_usd, provider.utilisation_percent, provider.decode_tokens_per_s,
                   provider.prefill_tokens_per_s or None, provider.throughput_measured_at)

    def output_per_million(self) -> int:
        return per_million_micro_usd(self.hourly_micro_usd, self.utilisation_percent, self.decode_tokens_per_s)

    def input_per_million(self) -> int:
        # No prefill rate yet (only an assumed decode rate): prompts are left free rather than guessed.
        if self.prefill_tokens_per_s is None:
            return 0
        return per_million_micro_usd(self.hourly_micro_usd, self.utilisation_percent, self.prefill_tokens_per_s)

    def basis(self) -> str:
        """One line for the price history: where the figures came from."""
        prefill = f"{self.prefill_tokens_per_s:,.0f} prefill tok/s" if self.prefill_tokens_per_s else "no prefill rate"
        when = (f"measured by the workers {timezone.localtime(self.measured_at):%Y-%m-%d %H:%M}" if self.measured_at
                else "assumed (no worker has measured yet)")
        return f"{self.cost_basis()}; {self.decode_tokens_per_s:,.0f} decode tok/s, {prefill}, {when}"

    def cost_basis(self) -> str:
        """The machine's side of the basis (what a price's basis starts with): cost and utilisation."""
        return f"{format_usd(self.hourly_micro_usd)}/h at {self.utilisation_percent}% utilisation"

    def with_rates(self, decode_tokens_per_s: float, prefill_tokens_per_s: float | None, measured_at: datetime) -> LocalCost:
        """The same machine, at another engine's rates (a weight variant's own workers)."""
        return LocalCost(self.hourly_micro_usd, self.utilisation_percent, decode_tokens_per_s,
                         prefill_tokens_per_s or None, measured_at)

    def price(self, provider: Provider, model: str, effective_from: datetime) -> ModelPrice:
        """The ModelPrice row these figures give (not saved)."""
        return ModelPrice(
            provider=provider,
            model=model,
            input_per_million_micro_usd=self.input_per_million(),
            output_per_million_micro_usd=self.output_per_million(),
            cached_input_per_million_micro_usd=0,
            effective_from=effective_from,
            source=ModelPrice.Source.MEASURED,
            basis=self.basis(),
        )
