"""Batch jobs (staff only): start one for a batch-mode feature, watch its progress, read its outputs.

The job runs in an inference worker (inference/worker/batch.py); these pages only create it and
read the counters and items it saves as it goes. The detail page polls `batch_progress` once a second.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Page, Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse

from budgets.permissions import staff_required
from inference.batch_jobs import do_start_batch
from inference.models import BatchJob

from .forms import BatchForm

JOBS_PER_PAGE = 50
ITEMS_PER_PAGE = 100
FINISHED = (BatchJob.Status.DONE, BatchJob.Status.FAILED)


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
    return render(request, "inference/batches.html", {"page": page, "form": form})


@staff_required
def batch_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(BatchJob.objects.select_related("feature", "user"), pk=job_id)
    page = _items_page(job, request.GET.get("page"))
    config = {
        "progress_url": reverse("staff-batch-progress", args=[job.pk]) + f"?page={page.number}",
        "finished": job.status in FINISHED,
    }
    return render(request, "inference/batch_detail.html", {"job": job, "page": page, "batch_config": config})


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
