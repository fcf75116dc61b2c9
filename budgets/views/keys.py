"""An API key's own caps: its owner may lower them, staff may set anything; every change audited."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from accounts.models import ApiKey

from ..actions import do_set_key_caps
from ..forms import KeyCapsForm
from .config import flash_saved


def _get_key_for_user(request: HttpRequest, key_id: int) -> ApiKey:
    # Someone else's key is a 404 to its non-staff viewer, exactly like one that does not exist.
    key = ApiKey.objects.select_related("user").filter(pk=key_id).first()
    if key is None or not (request.user.is_staff or key.user_id == request.user.pk):
        raise Http404("No such key.")
    return key


@login_required
def key_caps(request: HttpRequest, key_id: int) -> HttpResponse:
    key = _get_key_for_user(request, key_id)
    form = KeyCapsForm(request.POST if request.method == "POST" else None, key=key, lower_only=not request.user.is_staff)
    if form.is_bound and form.is_valid():
        flash_saved(request, len(do_set_key_caps(request.user, key, form.caps())))
        if key.user_id == request.user.pk:
            return redirect("api-keys")
        return redirect("staff-user", key.user_id)
    return render(request, "budgets/key_caps.html", {"key": key, "form": form})
