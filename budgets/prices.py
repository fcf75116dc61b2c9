"""Published prices of hosted models, imported from tokencost's maintained catalog (model_prices.json).

tokencost is installed with --no-deps and never imported: we only read its JSON file. Each import
adds a new ModelPrice row only where the catalog's price changed, so the cost of past requests (which
point at the row in force when they ran) is never rewritten; a price staff typed is never replaced.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from django.db import transaction

from .models import ModelPrice, Provider

CATALOG_PACKAGE = "tokencost"
MICRO_USD_PER_MILLION_PER_USD_PER_TOKEN = 10**12  # $/token → µ$ per million tokens


class CatalogError(RuntimeError):
    pass


@dataclass(frozen=True)
class CatalogPrice:
    provider: str
    model: str
    input_per_million_micro_usd: int
    output_per_million_micro_usd: int
    cached_input_per_million_micro_usd: int
    context_window: int | None


@dataclass
class ImportReport:
    created: int = 0
    unchanged: int = 0
    kept_staff_price: int = 0
    providers_created: list[str] = field(default_factory=list)


def catalog_path() -> Path:
    spec = importlib.util.find_spec(CATALOG_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CatalogError("The tokencost package is not installed (pip install --no-deps tokencost).")
    path = Path(spec.submodule_search_locations[0]) / "model_prices.json"
    if not path.exists():
        raise CatalogError(f"{path} is missing from the tokencost package")
    return path


def load_catalog(path: Path) -> list[CatalogPrice]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CatalogError(f"cannot read {path}: {exc}") from None
    prices = []
    for model, entry in raw.items():
        if not isinstance(entry, dict) or "input_cost_per_token" not in entry or "output_cost_per_token" not in entry:
            continue  # embeddings, images, the sample spec: not priced per token both ways
        prices.append(
            CatalogPrice(
                provider=str(entry.get("litellm_provider") or "unknown"),
                model=model,
                input_per_million_micro_usd=_micro(entry["input_cost_per_token"]),
                output_per_million_micro_usd=_micro(entry["output_cost_per_token"]),
                cached_input_per_million_micro_usd=_micro(entry.get("cache_read_input_token_cost") or 0),
                context_window=_int_or_none(entry.get("max_input_tokens")),
            )
        )
    return prices


def _micro(per_token_usd) -> int:
    return max(0, round(float(per_token_usd) * MICRO_USD_PER_MILLION_PER_USD_PER_TOKEN))


def _int_or_none(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


@transaction.atomic
def import_catalog(prices: list[CatalogPrice], now: datetime, only_providers: set[str] | None = None) -> ImportReport:
    report = ImportReport()
    wanted = [p for p in prices if only_providers is None or p.provider in only_providers]
    providers = {p.name: p for p in Provider.objects.filter(name__in={p.provider for p in wanted})}
    for name in sorted({p.provider for p in wanted} - providers.keys()):
        providers[name] = Provider.objects.create(name=name, kind=Provider.Kind.OPENAI_COMPATIBLE)
        report.providers_created.append(name)
    latest = _latest_prices(providers.values())
    new_rows = []
    for price in wanted:
        provider = providers[price.provider]
        current = latest.get((provider.pk, price.model))
        if current is not None and current.source == ModelPrice.Source.STAFF:
            report.kept_staff_price += 1
        elif current is not None and _same(current, price):
            report.unchanged += 1
        else:
            new_rows.append(_row(provider, price, now))
    ModelPrice.objects.bulk_create(new_rows, ignore_conflicts=True)
    report.created = len(new_rows)
    return report


def _latest_prices(providers) -> dict[tuple[int, str], ModelPrice]:
    """The row in force for every (provider, model), in one query (rows come newest first)."""
    latest: dict[tuple[int, str], ModelPrice] = {}
    for row in ModelPrice.objects.filter(provider__in=list(providers)).order_by("provider_id", "model", "-effective_from"):
        latest.setdefault((row.provider_id, row.model), row)
    return latest


def _same(row: ModelPrice, price: CatalogPrice) -> bool:
    return (
        row.input_per_million_micro_usd == price.input_per_million_micro_usd
        and row.output_per_million_micro_usd == price.output_per_million_micro_usd
        and row.cached_input_per_million_micro_usd == price.cached_input_per_million_micro_usd
    )


def _row(provider: Provider, price: CatalogPrice, now: datetime) -> ModelPrice:
    return ModelPrice(
        provider=provider,
        model=price.model,
        input_per_million_micro_usd=price.input_per_million_micro_usd,
        output_per_million_micro_usd=price.output_per_million_micro_usd,
        cached_input_per_million_micro_usd=price.cached_input_per_million_micro_usd,
        context_window=price.context_window,
        effective_from=now,
        source=ModelPrice.Source.CATALOG,
    )
