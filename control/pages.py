"""The staff page of staff API tokens (/staff/tokens/): every token, a new one for yourself (shown once),
revoking any. Creation and revocation are audited (control/actions.py)."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from budgets.permissions import staff_required

from .actions import do_create_staff_token, do_revoke_staff_token
from .models import StaffToken


class StaffTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the token is for, e.g. terraform or a nightly report.")


@staff_required
def tokens(request: HttpRequest) -> HttpResponse:
    """GET: the list; POST with `name`: a new token for you, shown once; POST with `revoke`: revoke that token."""
    if request.method == "POST" and "revoke" in request.POST:
        return _revoke(request)
    form = StaffTokenForm(request.POST or None)
    created = None
    if form.is_bound and form.is_valid():
        token, plaintext = do_create_staff_token(request.user, request.user, form.cleaned_data["name"].strip())
        # Rendered, not redirected: the plaintext must not travel through the session or a cookie.
        created = {"token": token, "plaintext": plaintext}
        form = StaffTokenForm()
    listed = StaffToken.objects.select_related("user")
    response = render(request, "control/tokens.html", {"form": form, "created": created, "tokens": listed})
    if created:
        response["Cache-Control"] = "no-store"
    return response


def _revoke(request: HttpRequest) -> HttpResponse:
    token_id = request.POST["revoke"]
    token = get_object_or_404(StaffToken.objects.select_related("user"), pk=token_id if token_id.isdigit() else 0)
    if do_revoke_staff_token(request.user, token):
        messages.success(request, f"Revoked the staff token {token.name!r} ({token.prefix}…); it stops working at once.")
    else:
        messages.info(request, f"The staff token {token.name!r} was revoked already.")
    return redirect("staff-tokens")
