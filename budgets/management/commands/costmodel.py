"""`manage.py costmodel [--feature NAME] [--users N] [--target USD] [...] [--json]`: the cost model page, in a terminal."""

from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from budgets import costmodel
from budgets.costmodel_data import initial_from_logs
from budgets.forms import CostModelForm
from budgets.models import Feature, ModelPrice

OVERRIDES = {
    "users": "users", "target": "target_usd", "system_prompt_tokens": "system_prompt_tokens",
    "retrieved_tokens": "retrieved_tokens", "input_usd_per_million": "input_usd_per_million",
    "output_usd_per_million": "output_usd_per_million", "hourly_usd": "hourly_usd",
    "utilisation_percent": "utilisation_percent", "machine_decode_tokens_per_s": "machine_decode_tokens_per_s",
}


class Command(DatabaseCommand):
    help = "Model the monthly cost per user of a feature, from its logs where it has them."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--feature", help="prefill prompt/output lengths and requests per user from this feature's logs")
        parser.add_argument("--users", type=int)
        parser.add_argument("--target", type=float, help="target price per user per month in dollars")
        parser.add_argument("--system-prompt-tokens", type=int)
        parser.add_argument("--retrieved-tokens", type=int)
        parser.add_argument("--model", help="price at this hosted model's published price (see import_prices)")
        parser.add_argument("--input-usd-per-million", type=float)
        parser.add_argument("--output-usd-per-million", type=float)
        parser.add_argument("--hourly-usd", type=float, help="self-hosted: the machine's hourly cost")
        parser.add_argument("--utilisation-percent", type=float)
        parser.add_argument("--machine-decode-tokens-per-s", type=float)
        parser.add_argument("--json", action="store_true", help="print the full result as JSON")

    def handle(self, *args, **options) -> None:
        feature = None
        if options["feature"]:
            feature = Feature.objects.filter(name=options["feature"]).first()
            if feature is None:
                raise CommandError(f"There is no feature named {options['feature']!r}.")
        data, note = initial_from_logs(feature)
        data = {**data, **{field: options[opt] for opt, field in OVERRIDES.items() if options.get(opt) is not None}}
        data["pricing"] = self._pricing(options, data)
        form = CostModelForm(data)
        if not form.is_valid():
            raise CommandError("; ".join(f"{name}: {' '.join(errors)}" for name, errors in form.errors.items()))
        try:
            inputs, _ = form.to_inputs()
            result = costmodel.run(inputs)
        except costmodel.CostModelError as exc:
            raise CommandError(str(exc)) from None
        if options["json"]:
            self.stdout.write(json.dumps({"source": note, "price": inputs.price.label, **result.as_dict()}))
            return
        summary = result.per_user_month_usd
        self.stdout.write(note)
        self.stdout.write(result.verdict)
        self.stdout.write(
            f"per user per month: mean ${summary['mean']:.4f}  p50 ${summary['p50']:.4f}  p90 ${summary['p90']:.4f}  "
            f"p99 ${summary['p99']:.4f}  max ${summary['max']:.4f}; total ${result.total_month_usd:,.2f}; "
            f"top 1% share {result.top1_share:.1%}"
        )
        for control in result.controls:
            self.stdout.write(f"  {control['control']}: {control['cap']} (p99 ${control['p99_usd']:.4f})")

    def _pricing(self, options, data: dict) -> str:
        if options["model"]:
            row = ModelPrice.objects.filter(model=options["model"]).order_by("-effective_from").first()
            if row is None:
                raise CommandError(f"No price for model {options['model']!r}; run import_prices or give --input/--output prices.")
            data["price"] = row.pk
            return "hosted"
        if options["hourly_usd"] is not None:
            return "self"
        return "custom"
