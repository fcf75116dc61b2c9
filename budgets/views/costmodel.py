"""The cost model page: what a feature costs per user per month, from real numbers where they exist."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from .. import costmodel
from ..costmodel_data import initial_from_logs
from ..forms import CostModelForm
from ..models import Feature
from ..permissions import staff_required


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
