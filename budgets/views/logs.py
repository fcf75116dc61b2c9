"""Cost per user (the long tail), the token log browser with CSV export, and "my usage"."""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from itertools import islice

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.db.models import Q, QuerySet
from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone

from ..charts import request_latency_parts
from ..forms import Cursor, LogFilterForm, PeriodForm, Position
from ..models import TokenLog
from ..periods import period_bounds
from ..permissions import staff_required
from ..usage import cost_per_user as cost_tail
from ..usage import my_usage as usage_for

PAGE_SIZE = 100
COUNT_CAP = 10_000  # the page says "10,000+" rather than counting a million rows on every view
CSV_CHUNK = 2_000
# team and tags last, so scripts that read the columns by position keep working.
CSV_COLUMNS = [
    "created_at", "request_id", "user", "feature", "model", "status", "refusal_code",
    "prompt_tokens", "completion_tokens", "cost_usd", "ttft_ms", "total_ms", "team", "tags",
]
_CSV_FIELDS = [
    "created_at", "request_id", "user__username", "feature__name", "model", "status", "refusal_code",
    "prompt_tokens", "completion_tokens", "cost_micro_usd", "ttft_ms", "total_ms", "team__name", "tags",
]


# --- cost per user -------------------------------------------------------------------------------


@staff_required
def cost_per_user(request):
    form = PeriodForm(request.GET)
    period = form.period_or_default()
    start, end = period_bounds(period, timezone.now())
    tail = cost_tail(start, end)
    chart = {
        "histogram": {"x": [b.label for b in tail.histogram], "y": [b.users for b in tail.histogram]},
        "concentration": {
            "x": [round(100 * x, 3) for x, _ in tail.concentration],
            "y": [round(100 * y, 3) for _, y in tail.concentration],
        },
    }
    context = {"form": form, "period": period, "tail": tail, "chart": chart, "end_shown": end - timedelta(seconds=1)}
    return render(request, "budgets/costs.html", context)


# --- the token log -------------------------------------------------------------------------------


@staff_required
def token_logs(request):
    form = LogFilterForm(request.GET)
    if not form.is_valid():
        return render(request, "budgets/logs.html", {"form": form, "rows": []}, status=400)
    rows = form.filtered()
    if request.GET.get("format") == "csv":
        return _csv_response(request, rows)
    page, newer, older = _keyset_page(rows, form.cleaned_data["before"], form.cleaned_data["after"])
    matching = rows[: COUNT_CAP + 1].count()
    context = {
        "form": form,
        "rows": page,
        "newer": newer,
        "older": older,
        "matching": min(matching, COUNT_CAP),
        "more_than_cap": matching > COUNT_CAP,
    }
    return render(request, "budgets/logs.html", context)


@staff_required
def request_detail(request, request_id: str):
    """One ledger row: what it used and cost, and where its time went (retrieval, prefill, decode)."""
    row = get_object_or_404(TokenLog.objects.select_related("user", "feature", "requested_feature", "provider"),
                            request_id=request_id)
    parts = request_latency_parts(row)
    context = {"row": row, "parts": parts, "parts_total_ms": sum(p.ms for p in parts)}
    return render(request, "budgets/request_detail.html", context)


def _keyset_page(
    rows: QuerySet[TokenLog], before: Position | None, after: Position | None
) -> tuple[list[TokenLog], str | None, str | None]:
    """One page, newest first, by (created_at, id) keyset: the cost of page 1,000 is that of page 1.

    Returns the rows and the cursors for the newer and older pages (None where there is none).
    """
    rows = rows.select_related("user", "feature", "requested_feature").only(
        "request_id", "created_at", "status", "refusal_code", "model", "prompt_tokens", "completion_tokens",
        "cost_micro_usd", "ttft_ms", "total_ms", "user__username", "feature__name", "requested_feature__name", "tags",
    )
    if after:
        # Going back towards the newest: read ascending from the cursor, then flip.
        at, pk = after
        # created_at__gte is implied by the OR, but spelled out it bounds the index range scan.
        newer_rows = rows.filter(Q(created_at__gt=at) | Q(created_at=at, pk__gt=pk), created_at__gte=at)
        found = list(newer_rows.order_by("created_at", "id")[: PAGE_SIZE + 1])
        page = found[:PAGE_SIZE][::-1]
        newer = Cursor.encode(page[0]) if len(found) > PAGE_SIZE else None
        older = Cursor.encode(page[-1]) if page else None
        return page, newer, older
    if before:
        at, pk = before
        rows = rows.filter(Q(created_at__lt=at) | Q(created_at=at, pk__lt=pk), created_at__lte=at)
    found = list(rows.order_by("-created_at", "-id")[: PAGE_SIZE + 1])
    page = found[:PAGE_SIZE]
    older = Cursor.encode(page[-1]) if len(found) > PAGE_SIZE else None
    newer = Cursor.encode(page[0]) if before and page else None
    return page, newer, older


def _csv_response(request, rows: QuerySet[TokenLog]) -> StreamingHttpResponse:
    chunks = _csv_chunks(rows.order_by("-created_at", "-id").values_list(*_CSV_FIELDS))
    # Under ASGI (daphne) Django would read a *sync* iterator into one list before sending it,
    # holding the whole export in memory; there it gets an async iterator instead.
    content = _driven_from_sync_thread(chunks) if isinstance(request, ASGIRequest) else chunks
    response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
    stamp = timezone.localtime().strftime("%Y%m%d-%H%M")
    response["Content-Disposition"] = f'attachment; filename="token-log-{stamp}.csv"'
    return response


class _Echo:
    """csv.writer wants a file; this one hands each formatted line straight back."""

    def write(self, value: str) -> str:
        return value


def _csv_chunks(rows: QuerySet) -> Iterator[str]:
    """The header, then one string per CSV_CHUNK rows, read through a server-side cursor."""
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    iterator = rows.iterator(chunk_size=CSV_CHUNK)
    while chunk := list(islice(iterator, CSV_CHUNK)):
        yield "".join(writer.writerow(_csv_cells(row)) for row in chunk)


async def _driven_from_sync_thread(chunks: Iterator[str]) -> AsyncIterator[str]:
    """Each step of a sync iterator run in Django's sync thread, where the request's connection lives.

    Not QuerySet.aiterator(): for values_list() it runs the query in the event loop
    (SynchronousOnlyOperation, Django 5.2), after the headers are already sent.
    """
    step = sync_to_async(next)
    while (chunk := await step(chunks, None)) is not None:
        yield chunk


def _csv_cells(row: tuple) -> list:
    created, request_id, username, feature, model, status, code, prompt, completion, cost, ttft, total, team, tags = row
    return [
        timezone.localtime(created).isoformat(), _cell(request_id), _cell(username or ""), feature or "",
        _cell(model), status, code, prompt, completion, _dollars(cost), "" if ttft is None else ttft,
        "" if total is None else total, _cell(team or ""), _csv_tags(tags),
    ]


def _csv_tags(stored: str) -> str:
    """",support,beta," as the row stores them → "support beta": one cell, split on spaces (a tag has none)."""
    return " ".join(tag for tag in stored.split(",") if tag)


def _cell(text: str) -> str:
    # A spreadsheet runs a cell starting with = + - @ as a formula; user-supplied text must not.
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def _dollars(micro_usd: int) -> str:
    """Exact: micro-dollars as dollars with six decimals, without passing through a float."""
    sign = "-" if micro_usd < 0 else ""
    whole, fraction = divmod(abs(micro_usd), 1_000_000)
    return f"{sign}{whole}.{fraction:06d}"


# --- my usage ------------------------------------------------------------------------------------


@login_required
def my_usage(request):
    now = timezone.now()
    context = {"usage": usage_for(request.user, now), "now": now}
    return render(request, "budgets/my_usage.html", context)
