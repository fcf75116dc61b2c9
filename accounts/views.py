"""The logged-in user's own API keys: list, create (the key is shown once), revoke.

Rotating a key is audited, so it lives with the audit trail: budgets/views/keys.py."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from .actions import do_create_api_key, do_revoke_api_key
from .forms import ApiKeyForm
from .models import ApiKey


@login_required
def api_keys(request: HttpRequest) -> HttpResponse:
    created = None
    form = ApiKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        key, plaintext = do_create_api_key(request.user, form.cleaned_data["name"], expires_at=form.expires_at())
        # Rendered, not redirected: the plaintext must not travel through the session or a cookie.
        created = {"key": key, "plaintext": plaintext}
        form = ApiKeyForm()
    context = {"form": form, "created": created, "keys": ApiKey.objects.filter(user=request.user).prefetch_related("successors")}
    response = render(request, "accounts/keys.html", context)
    if created:
        response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def revoke_api_key(request: HttpRequest, key_id: int) -> HttpResponse:
    key = _get_key_for_user(request, key_id)
    if do_revoke_api_key(key):
        messages.success(request, f"Revoked the key {key.name!r}; it stops working at once.")
    return redirect("api-keys")


def _get_key_for_user(request: HttpRequest, key_id: int) -> ApiKey:
    # Someone else's key id is a 404, exactly like one that does not exist.
    return get_object_or_404(ApiKey, pk=key_id, user=request.user)
