from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from budgets.models import Feature


@login_required
def chat(request: HttpRequest) -> HttpResponse:
    # Batch features run as jobs staff start; they have no place in an interactive chat.
    features = list(
        Feature.objects.filter(enabled=True).exclude(mode=Feature.Mode.BATCH).order_by("name").values_list("name", flat=True)
    )
    config = {
        "features": features,
        "default_max_tokens": settings.CEILING_DEFAULT_MAX_TOKENS,
        "max_tokens_limit": settings.CEILING_MAX_TOKENS_LIMIT,
    }
    return render(request, "inference/chat.html", {"chat_config": config})
