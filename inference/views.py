from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from budgets.models import Feature, TokenLog
from budgets.usage import today_allowance


@login_required
def chat(request: HttpRequest) -> HttpResponse:
    # Batch features run as jobs staff start; they have no place in an interactive chat.
    features = list(
        Feature.objects.filter(enabled=True).exclude(mode=Feature.Mode.BATCH).order_by("name").values_list("name", flat=True)
    )
    config = {
        "features": features,
        "default_feature": default_feature(features),
        "default_max_tokens": settings.CEILING_DEFAULT_MAX_TOKENS,
        "max_tokens_limit": settings.CEILING_MAX_TOKENS_LIMIT,
        # The same object `done` and `refused` frames carry: the page draws it and redraws it after each answer.
        "allowance": today_allowance(request.user, timezone.now()),
    }
    return render(request, "inference/chat.html", {"chat_config": config})


def default_feature(names: list[str]) -> str | None:
    """The feature the chat page opens on: the one staff marked as default, else `chat`, else the first."""
    marked = Feature.objects.filter(is_default=True, name__in=names).values_list("name", flat=True).first()
    if marked is not None:
        return marked
    if "chat" in names:
        return "chat"
    return names[0] if names else None


@login_required
@require_GET
def request_transcript(request: HttpRequest, request_id: str) -> JsonResponse:
    """One of the user's own requests as stored: what a chat client shows after it lost frames.

    The stream may drop token frames; the ledger and the transcript never do. Another
    user's request is a 404, exactly like one that does not exist.
    """
    row = _get_request_for_user(request, request_id)
    transcript = getattr(row, "transcript", None)
    return JsonResponse({
        "request_id": row.request_id,
        "status": row.status,
        "text": transcript.response_text if transcript is not None else "",
        "usage": row.usage(),
        "finish_reason": row.finish_reason,
    })


def _get_request_for_user(request: HttpRequest, request_id: str) -> TokenLog:
    row = TokenLog.objects.select_related("transcript").filter(request_id=request_id, user=request.user).first()
    if row is None:
        raise Http404("No such request")
    return row
