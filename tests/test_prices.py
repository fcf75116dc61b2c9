"""Prices come from tokencost's catalog; history is kept and staff overrides survive a re-import."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.management import CommandError, call_command

from budgets.models import ModelPrice, Provider
from budgets.prices import catalog_path, import_catalog, load_catalog

pytestmark = pytest.mark.django_db

UTC = ZoneInfo("UTC")


def test_the_installed_catalog_has_well_known_models():
    prices = {p.model: p for p in load_catalog(catalog_path())}
    mini = prices["gpt-4o-mini"]
    assert (mini.provider, mini.input_per_million_micro_usd, mini.output_per_million_micro_usd) == ("openai", 150_000, 600_000)
    assert mini.cached_input_per_million_micro_usd == 75_000 and mini.context_window == 128_000


def test_import_prices_command_loads_one_provider():
    out = io.StringIO()
    call_command("import_prices", "--provider", "openai", stdout=out)
    assert "new price(s)" in out.getvalue()
    openai = Provider.objects.get(name="openai")
    assert openai.kind == Provider.Kind.OPENAI_COMPATIBLE
    price = ModelPrice.objects.get(provider=openai, model="gpt-4o-mini")
    assert price.source == ModelPrice.Source.CATALOG and price.cost_micro_usd(1_000_000, 0) == 150_000
    assert not Provider.objects.filter(name="anthropic").exists()


def write_catalog(tmp_path, input_cost: float) -> str:
    path = tmp_path / "model_prices.json"
    path.write_text(json.dumps({"m1": {"litellm_provider": "acme", "input_cost_per_token": input_cost, "output_cost_per_token": 2e-6}}))
    return path


def test_a_changed_price_adds_a_row_and_keeps_history(tmp_path):
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    import_catalog(load_catalog(write_catalog(tmp_path, 1e-6)), t0)
    import_catalog(load_catalog(write_catalog(tmp_path, 1e-6)), t0 + timedelta(days=1))  # unchanged: no row
    report = import_catalog(load_catalog(write_catalog(tmp_path, 3e-6)), t0 + timedelta(days=2))
    assert report.created == 1
    rows = list(ModelPrice.objects.filter(model="m1").order_by("effective_from"))
    assert [r.input_per_million_micro_usd for r in rows] == [1_000_000, 3_000_000]


def test_a_staff_override_survives_a_reimport(tmp_path):
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    import_catalog(load_catalog(write_catalog(tmp_path, 1e-6)), t0)
    acme = Provider.objects.get(name="acme")
    ModelPrice.objects.create(provider=acme, model="m1", input_per_million_micro_usd=5, output_per_million_micro_usd=5,
                              effective_from=t0 + timedelta(hours=1), source=ModelPrice.Source.STAFF)
    report = import_catalog(load_catalog(write_catalog(tmp_path, 9e-6)), t0 + timedelta(days=1))
    assert report.kept_staff_price == 1 and report.created == 0


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(CommandError, match="No provider named nosuch"):
        call_command("import_prices", "--provider", "nosuch", stdout=io.StringIO())
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(CommandError, match="cannot read"):
        call_command("import_prices", "--file", str(broken), stdout=io.StringIO())
