"""An API key's own caps and features: its owner may lower or narrow them, staff may set anything;
its rotation by its owner. Every change audited."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts.models import ApiKey

from ..actions import MAX_GRACE_HOURS, KeyNotRotatable, do_rotate_api_key, do_set_key_caps
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


class RotateForm(forms.Form):
    grace_hours = forms.IntegerField(min_value=0, max_value=MAX_GRACE_HOURS, initial=24)


@login_required
@require_POST
def rotate_key(request: HttpRequest, key_id: int) -> HttpResponse:
    """The owner rotates their key; the new key is shown once, here (staff use `rotate_api_key`)."""
    key = _get_key_for_user(request, key_id)
    if key.user_id != request.user.pk:
        raise Http404("No such key.")  # staff would see another person's new secret: not here
    form = RotateForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The grace period must be 0 to {MAX_GRACE_HOURS} hours.")
        return redirect("api-keys")
    try:
        new, plaintext = do_rotate_api_key(request.user, key.pk, timedelta(hours=form.cleaned_data["grace_hours"]))
    except KeyNotRotatable as exc:
        messages.error(request, str(exc))
        return redirect("api-keys")
    key.refresh_from_db(fields=["expires_at"])
    # Rendered, not redirected: the plaintext must not travel through the session or a cookie.
    response = render(request, "budgets/key_rotated.html", {"old": key, "new": new, "plaintext": plaintext})
    response["Cache-Control"] = "no-store"
    return response
