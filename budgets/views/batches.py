"""Batch jobs (staff only): start one for a batch-mode feature, watch its progress, read its outputs.

The job runs in an inference worker (inference/batch.py); these pages only create it and read the
counters and items it saves as it goes. The detail page polls `batch_progress` once a second.
"""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse

from inference.batch import do_start_batch
from inference.models import BatchJob

from ..models import Feature
from ..permissions import staff_required

JOBS_PER_PAGE = 50
ITEMS_PER_PAGE = 100
MAX_ITEMS = 1000
MAX_INPUT_CHARS = 20_000
FINISHED = (BatchJob.Status.DONE, BatchJob.Status.FAILED)


class BatchForm(forms.Form):
    feature = forms.ModelChoiceField(
        queryset=Feature.objects.filter(mode=Feature.Mode.BATCH, enabled=True).order_by("name"),
        empty_label=None,
        help_text="Enabled features whose mode is batch.",
        error_messages={
            "required": "Choose a feature.",
            "invalid_choice": "Choose one of the listed features: only enabled features in batch mode run jobs.",
        },
    )
    username = forms.CharField(label="Run as (username)", max_length=150, help_text="The job counts against this user's caps.")
    max_tokens = forms.IntegerField(
        label="Max tokens per answer", min_value=1, max_value=settings.CEILING_MAX_TOKENS_LIMIT, initial=128
    )
    inputs = forms.CharField(
        label="Inputs, one per line",
        widget=forms.Textarea(attrs={"rows": 8}),
        error_messages={"required": "Give at least one input, one per line."},
    )

    def clean_username(self):
        name = self.cleaned_data["username"].strip()
        user = get_user_model().objects.filter(username=name, is_active=True).first()
        if user is None:
            raise forms.ValidationError(f"There is no active user named {name!r}.")
        return user

    def clean_inputs(self) -> list[str]:
        lines = [line.strip() for line in self.cleaned_data["inputs"].splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise forms.ValidationError("Give at least one input, one per line (blank lines are skipped).")
        if len(lines) > MAX_ITEMS:
            raise forms.ValidationError(f"{len(lines):,} inputs is too many for one job; the limit is {MAX_ITEMS:,}.")
        for number, line in enumerate(lines, start=1):
            if len(line) > MAX_INPUT_CHARS:
                raise forms.ValidationError(f"Input {number} is longer than {MAX_INPUT_CHARS:,} characters.")
        return lines


@staff_required
def batches(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        form = BatchForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            job = do_start_batch(
                feature=data["feature"], user=data["username"], max_tokens=data["max_tokens"], prompts=data["inputs"]
            )
            messages.success(request, f"Started batch {job.pk}: {job.total} input{'s' if job.total != 1 else ''}.")
            return redirect("staff-batch", job.pk)
        messages.error(request, "No job was started: please correct the errors below.")
    else:
        form = BatchForm(initial={"username": request.user.get_username()})
    jobs = BatchJob.objects.select_related("feature", "user").order_by("-created_at", "-pk")
    page = Paginator(jobs, JOBS_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "budgets/batches.html", {"page": page, "form": form})


@staff_required
def batch_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(BatchJob.objects.select_related("feature", "user"), pk=job_id)
    page = _items_page(job, request.GET.get("page"))
    config = {
        "progress_url": reverse("staff-batch-progress", args=[job.pk]) + f"?page={page.number}",
        "finished": job.status in FINISHED,
    }
    return render(request, "budgets/batch_detail.html", {"job": job, "page": page, "batch_config": config})


@staff_required
def batch_progress(request: HttpRequest, job_id: int) -> JsonResponse:
    """The job's counters and the items of one page of the detail view, as batch.js shows them."""
    job = get_object_or_404(BatchJob, pk=job_id)
    page = _items_page(job, request.GET.get("page"))
    return JsonResponse(
        {
            "status": job.status,
            "total": job.total,
            "done": job.done,
            "failed": job.failed,
            "processed": job.done + job.failed,
            "finished": job.status in FINISHED,
            "items": [
                {"index": item.index, "status": item.status, "output": item.output, "error": item.error, "request_id": item.request_id}
                for item in page
            ],
        }
    )


def _items_page(job: BatchJob, number: str | None) -> Page:
    return Paginator(job.items.order_by("index"), ITEMS_PER_PAGE).get_page(number)
