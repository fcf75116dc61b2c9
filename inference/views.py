from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from budgets.models import Feature


@login_required
def chat(request: HttpRequest) -> HttpResponse:
    features = list(Feature.objects.filter(enabled=True).order_by("name").values_list("name", flat=True))
    config = {
        "features": features,
        "default_max_tokens": settings.CEILING_DEFAULT_MAX_TOKENS,
        "max_tokens_limit": settings.CEILING_MAX_TOKENS_LIMIT,
    }
    return render(request, "inference/chat.html", {"chat_config": config})
