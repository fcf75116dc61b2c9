"""The cost model page: what a feature costs per user per month, from real numbers where they exist."""

from __future__ import annotations

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from .. import costmodel
from ..costmodel_data import DEFAULT_DECODE_TOKENS_PER_S, DEFAULT_OVERHEAD_MS, DEFAULT_PREFILL_TOKENS_PER_S, observe
from ..models import Feature, ModelPrice
from ..permissions import staff_required

PRICING = [("hosted", "a hosted model's published price"), ("custom", "a price I type"), ("self", "my own machine")]
REQUEST_LAWS = [("lognormal", "lognormal (median, sigma)"), ("pareto", "power law (minimum, alpha)")]

DEFAULTS = {
    "users": 1000, "system_prompt_tokens": 200, "retrieved_tokens": 0,
    "prompt_median": 120, "prompt_sigma": 0.6, "output_median": 250, "output_sigma": 0.5,
    "requests_law": "lognormal", "requests_a": 3, "requests_b": 1.0,
    "pricing": "custom", "input_usd_per_million": 0.15, "output_usd_per_million": 0.60,
    "hourly_usd": 3.60, "utilisation_percent": 70, "machine_decode_tokens_per_s": 2400,
    "overhead_ms": DEFAULT_OVERHEAD_MS, "prefill_tokens_per_s": DEFAULT_PREFILL_TOKENS_PER_S,
    "decode_tokens_per_s": DEFAULT_DECODE_TOKENS_PER_S, "retrieval_ms": 0, "target_usd": 2.0,
}


class CostModelForm(forms.Form):
    feature = forms.ModelChoiceField(Feature.objects.order_by("name"), required=False, help_text="prefill from its logs")
    users = forms.IntegerField(min_value=1, max_value=100_000_000)
    system_prompt_tokens = forms.IntegerField(min_value=0, max_value=1_000_000)
    retrieved_tokens = forms.IntegerField(min_value=0, max_value=1_000_000)
    prompt_median = forms.FloatField(min_value=0.001, label="user prompt tokens, median")
    prompt_sigma = forms.FloatField(min_value=0, max_value=5, label="user prompt tokens, sigma")
    output_median = forms.FloatField(min_value=0.001, label="output tokens, median")
    output_sigma = forms.FloatField(min_value=0, max_value=5, label="output tokens, sigma")
    requests_law = forms.ChoiceField(choices=REQUEST_LAWS, label="requests per user per day")
    requests_a = forms.FloatField(min_value=0.0001, label="median (lognormal) or minimum (power law)")
    requests_b = forms.FloatField(min_value=0, max_value=10, label="sigma (lognormal) or alpha (power law)")
    pricing = forms.ChoiceField(choices=PRICING)
    price = forms.ModelChoiceField(ModelPrice.objects.select_related("provider").order_by("provider__name", "model", "-effective_from"), required=False)
    input_usd_per_million = forms.FloatField(min_value=0, required=False)
    output_usd_per_million = forms.FloatField(min_value=0, required=False)
    hourly_usd = forms.FloatField(min_value=0, required=False)
    utilisation_percent = forms.FloatField(min_value=0.1, max_value=100, required=False)
    machine_decode_tokens_per_s = forms.FloatField(min_value=0.001, required=False)
    overhead_ms = forms.FloatField(min_value=0)
    prefill_tokens_per_s = forms.FloatField(min_value=0.001)
    decode_tokens_per_s = forms.FloatField(min_value=0.001)
    retrieval_ms = forms.FloatField(min_value=0)
    target_usd = forms.FloatField(min_value=0.0001, label="target price per user per month ($)")

    def clean(self):
        data = super().clean()
        pricing = data.get("pricing")
        if pricing == "hosted" and not data.get("price"):
            self.add_error("price", "Pick the hosted model whose price to use.")
        if pricing == "custom":
            for name in ("input_usd_per_million", "output_usd_per_million"):
                if data.get(name) is None:
                    self.add_error(name, "Give the price per million tokens.")
        if pricing == "self":
            for name in ("hourly_usd", "utilisation_percent", "machine_decode_tokens_per_s"):
                if data.get(name) is None:
                    self.add_error(name, "Needed to price your own machine.")
        if data.get("requests_law") == "pareto" and data.get("requests_b") is not None and data["requests_b"] <= 1:
            self.add_error("requests_b", "A power law needs alpha above 1, or the mean is infinite.")
        return data

    def to_inputs(self) -> tuple[costmodel.Inputs, costmodel.SelfHosted | None]:
        d = self.cleaned_data
        machine = None
        if d["pricing"] == "hosted":
            row = d["price"]
            price = costmodel.Price(row.input_per_million_micro_usd / 1e6, row.output_per_million_micro_usd / 1e6, f"{row.provider}/{row.model}")
        elif d["pricing"] == "custom":
            price = costmodel.Price(d["input_usd_per_million"], d["output_usd_per_million"], "custom")
        else:
            machine = costmodel.SelfHosted(d["hourly_usd"], d["utilisation_percent"] / 100, d["machine_decode_tokens_per_s"])
            machine.validate()
            price = machine.as_price()
        law = (costmodel.Distribution.lognormal(d["requests_a"], d["requests_b"]) if d["requests_law"] == "lognormal"
               else costmodel.Distribution.pareto(d["requests_a"], d["requests_b"]))
        inputs = costmodel.Inputs(
            system_prompt_tokens=costmodel.Distribution.fixed(d["system_prompt_tokens"]),
            retrieved_tokens=costmodel.Distribution.fixed(d["retrieved_tokens"]),
            user_prompt_tokens=costmodel.Distribution.lognormal(d["prompt_median"], d["prompt_sigma"]),
            output_tokens=costmodel.Distribution.lognormal(d["output_median"], d["output_sigma"]),
            requests_per_user_per_day=law,
            users=d["users"],
            price=price,
            latency=costmodel.LatencyModel(d["overhead_ms"], d["prefill_tokens_per_s"], d["decode_tokens_per_s"], d["retrieval_ms"]),
            target_usd_per_user_month=d["target_usd"],
        )
        return inputs, machine


def initial_from_logs(feature: Feature | None) -> tuple[dict, str]:
    """The form's starting values: the feature's real numbers where it has logs, defaults elsewhere."""
    initial = dict(DEFAULTS)
    if feature is None:
        return initial, "No feature chosen: the inputs are examples; change them freely."
    seen = observe(feature, timezone.now())
    if not seen.requests:
        return {**initial, "feature": feature.pk}, f"{feature.name!r} has no completed requests yet: the inputs are examples."
    initial.update(feature=feature.pk, users=max(1, seen.users), system_prompt_tokens=0)
    if seen.prompt_tokens:
        initial.update(prompt_median=round(seen.prompt_tokens.median, 1), prompt_sigma=round(seen.prompt_tokens.sigma, 3))
    if seen.output_tokens:
        initial.update(output_median=round(seen.output_tokens.median, 1), output_sigma=round(seen.output_tokens.sigma, 3))
    if seen.requests_per_user_per_day:
        law = seen.requests_per_user_per_day
        initial.update(requests_law="lognormal", requests_a=round(law.median, 4), requests_b=round(law.sigma, 3))
    if seen.prefill_tokens_per_s:
        initial["prefill_tokens_per_s"] = round(seen.prefill_tokens_per_s, 1)
    if seen.decode_tokens_per_s:
        initial["decode_tokens_per_s"] = round(seen.decode_tokens_per_s, 2)
    return initial, f"Prefilled from {seen.requests:,} completed requests of {seen.users:,} users of {feature.name!r} in the last 30 days."


@staff_required
def cost_model(request: HttpRequest) -> HttpResponse:
    submitted = "users" in request.GET
    feature = Feature.objects.filter(pk=request.GET.get("feature") or 0).first() if request.GET.get("feature", "").isdigit() else None
    initial, source_note = initial_from_logs(feature)
    form = CostModelForm(request.GET if submitted else initial)
    result = machine = None
    error = ""
    if form.is_valid():
        try:
            inputs, machine = form.to_inputs()
            result = costmodel.run(inputs)
        except costmodel.CostModelError as exc:
            error = str(exc)
    context = {
        "form": form, "result": result, "error": error, "source_note": source_note, "machine": machine,
        "machine_view": _machine_view(machine, result),
        "chart_data": {"histogram": result.histogram, "cost_vs_prompt": result.cost_vs_prompt} if result else None,
    }
    return render(request, "budgets/costmodel.html", context, status=200 if result or not submitted else 400)


def _machine_view(machine: costmodel.SelfHosted | None, result: costmodel.Result | None) -> dict | None:
    if machine is None or result is None:
        return None
    output = max(1.0, result.mean_output_tokens)
    return {
        "responses_per_s": machine.responses_per_s(output),
        "per_1000": machine.usd_per_1000_responses(output),
        "per_million_tokens": machine.usd_per_million_tokens(),
    }
