"""The staff page of one feature: its settings (budgets' form and audit trail) and how it is served.

It lives in inference, not in budgets/views/, because the page also switches the feature's weight
variant behind the quantization evaluation gate (inference/actions.py), and budgets imports nothing
of inference. The list of features and every other staff page stay in budgets/views/config.py.
"""

from __future__ import annotations

from pathlib import Path

from django.contrib import messages
from django.db import IntegrityError
from django.db.models import Count, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from budgets.actions import do_save_with_audit, snapshot
from budgets.forms import FeatureForm
from budgets.models import Feature
from budgets.permissions import staff_required
from budgets.views.config import FEATURE_FIELDS, flash_saved
from inference.actions import (
    SwitchRefused,
    do_delete_document,
    do_save_document,
    do_set_model_aliases,
    do_switch_quantization,
    evaluation_refusal,
)
from inference.console.forms import DocumentUploadForm, ModelAliasesForm
from inference.models import Document, QuantizationEvaluation
from inference.variants import shipped_verdict_applies


@staff_required
def feature_detail(request: HttpRequest, feature_id: int) -> HttpResponse:
    feature = get_object_or_404(Feature.objects.select_related("provider"), pk=feature_id)
    if request.method == "POST" and request.POST.get("form") == "quantization":
        return _switch_quantization(request, feature)
    if request.method == "POST" and request.POST.get("form") == "delete-document":
        return _delete_document(request, feature)
    if request.method == "POST" and request.POST.get("form") == "document":
        upload_form = DocumentUploadForm(request.POST, request.FILES)
        if upload_form.is_valid():
            return _save_document(request, feature, upload_form)
        context = {"feature": feature, "name": feature.name, "form": FeatureForm(instance=feature),
                   "aliases_form": ModelAliasesForm(feature=feature)}
        context |= _quantization_context(feature) | _documents_context(feature, upload_form)
        return render(request, "inference/feature_detail.html", context, status=400)
    aliases_form = ModelAliasesForm(feature=feature)
    if request.method == "POST" and request.POST.get("form") == "aliases":
        aliases_form = ModelAliasesForm(request.POST, feature=feature)
        if aliases_form.is_valid() and _set_aliases(request, feature, aliases_form):
            return redirect("staff-feature", feature.pk)
        form = FeatureForm(instance=feature)
        context = {"feature": feature, "name": feature.name, "form": form, "aliases_form": aliases_form}
        return render(request, "inference/feature_detail.html", context | _quantization_context(feature) | _documents_context(feature))
    before = snapshot(feature, FEATURE_FIELDS)  # the form writes into the instance while validating
    form = FeatureForm(request.POST if request.method == "POST" else None, instance=feature)
    if form.is_bound and form.is_valid():
        entries = do_save_with_audit(request.user, feature, FEATURE_FIELDS, before, target=f"feature {feature.name}")
        flash_saved(request, len(entries))
        return redirect("staff-feature", feature.pk)
    context = {"feature": feature, "name": before["name"], "form": form, "aliases_form": aliases_form}
    context |= _quantization_context(feature) | _documents_context(feature)
    return render(request, "inference/feature_detail.html", context)


def _set_aliases(request: HttpRequest, feature: Feature, form: ModelAliasesForm) -> bool:
    """Save the aliases; False (with the form's error) when another feature took one meanwhile."""
    try:
        entry = do_set_model_aliases(request.user, feature, form.cleaned_data["aliases"])
    except IntegrityError:
        form.add_error("aliases", "Another feature took one of these aliases just now; an alias belongs to one feature.")
        return False
    flash_saved(request, 1 if entry else 0)
    return True


def _quantization_context(feature: Feature) -> dict:
    """Each quantized variant's latest evaluation of the feature and why a switch to it would be refused (or None)."""
    candidates = []
    for mode, label in Feature.Quantization.choices:
        if mode == Feature.Quantization.NONE:
            continue
        latest = QuantizationEvaluation.latest_for(feature, mode)  # one query per variant, read once
        candidates.append(
            {"mode": mode, "label": label, "evaluation": latest, "switch_refusal": evaluation_refusal(feature, mode, latest),
             "shipped": latest is None and shipped_verdict_applies(mode)}
        )
    return {"candidates": candidates}


def _switch_quantization(request: HttpRequest, feature: Feature) -> HttpResponse:
    """Serve the feature with other weights; refused with the reason unless its latest evaluation passed."""
    mode = request.POST.get("quantization", "")
    try:
        entries = do_switch_quantization(request.user, feature, mode)
    except SwitchRefused as exc:
        messages.error(request, f"Not switched: {exc}")
    else:
        if entries:
            messages.success(request, f"{feature.name} is now served with {feature.get_quantization_display()}.")
        else:
            messages.info(request, f"{feature.name} was already served with {feature.get_quantization_display()}.")
    return redirect("staff-feature", feature.pk)


# --- documents of a docs feature ------------------------------------------------------------------


def _documents_context(feature: Feature, upload_form: DocumentUploadForm | None = None) -> dict:
    documents = feature.documents.annotate(chunk_count=Count("chunks"), tokens=Sum("chunks__tokens")).order_by("name")
    return {"documents": documents, "upload_form": upload_form or DocumentUploadForm()}


def _save_document(request: HttpRequest, feature: Feature, form: DocumentUploadForm) -> HttpResponse:
    if feature.mode != Feature.Mode.DOCS:
        messages.error(request, f"{feature.name} is in {feature.mode} mode; documents serve a feature in docs mode. Switch its mode first.")
        return redirect("staff-feature", feature.pk)
    name = Path(form.cleaned_data["file"].name).name
    document, changed = do_save_document(request.user, feature, name, form.cleaned_data["text"], form.cleaned_data["audience"])
    if changed:
        messages.success(request, f"{name} is loaded: {document.chunks.count()} chunks, readable by {document.audience_label}.")
    else:
        messages.info(request, f"{name} was already loaded with this text and audience; nothing changed.")
    return redirect("staff-feature", feature.pk)


def _delete_document(request: HttpRequest, feature: Feature) -> HttpResponse:
    document = get_object_or_404(Document, pk=request.POST.get("document") or 0, feature=feature)
    do_delete_document(request.user, document)
    messages.success(request, f"{document.name} is deleted; {feature.name} no longer answers from it.")
    return redirect("staff-feature", feature.pk)
