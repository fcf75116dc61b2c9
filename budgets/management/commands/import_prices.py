"""`manage.py import_prices [--provider NAME ...] [--file PATH]`: load published prices from tokencost's catalog."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import CommandError
from django.utils import timezone

from accounts.management.database import DatabaseCommand
from budgets.prices import CatalogError, catalog_path, import_catalog, load_catalog


class Command(DatabaseCommand):
    help = "Import hosted-model prices from tokencost's model_prices.json (new rows only where a price changed)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--provider", action="append", dest="providers", help="only this provider (repeatable), e.g. openai")
        parser.add_argument("--file", type=Path, help="a model_prices.json to read instead of the installed one")

    def handle(self, *args, providers=None, file=None, **options) -> None:
        try:
            prices = load_catalog(file or catalog_path())
        except CatalogError as exc:
            raise CommandError(str(exc)) from None
        known = {p.provider for p in prices}
        unknown = sorted(set(providers or []) - known)
        if unknown:
            raise CommandError(f"No provider named {', '.join(unknown)} in the catalog (it has {len(known)}, e.g. openai, anthropic).")
        report = import_catalog(prices, timezone.now(), set(providers) if providers else None)
        self.stdout.write(
            self.style.SUCCESS(
                f"{report.created} new price(s), {report.unchanged} unchanged, "
                f"{report.kept_staff_price} staff override(s) kept, {len(report.providers_created)} provider(s) created"
            )
        )
