"""The staff alerts panel: this month's alerts with every channel's delivery, and the webhooks.

A channel that fails is shown here with its last attempt (when, status code or error, how many
attempts), so nobody has to read worker logs to learn that Slack has not heard of an alert.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from ..actions import do_create_webhook, do_delete_webhook, do_set_webhook_enabled
from ..forms import WebhookForm
from ..models import Alert, AlertWebhook, Period, WebhookDelivery
from ..periods import period_key
from ..permissions import staff_required
from ..webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, new_secret

ALERTS_SHOWN = 100
DELIVERIES_SHOWN = 50


@staff_required
def alerts(request: HttpRequest) -> HttpResponse:
    form = WebhookForm(request.POST or None)
    if form.is_bound and form.is_valid():
        secret = new_secret()
        hook, _ = do_create_webhook(
            request.user, provider=form.cleaned_data["provider"], team=form.cleaned_data["team"], url=form.cleaned_data["url"],
            body_format=form.cleaned_data["body_format"], secret=secret,
        )
        # Like an API key: shown this once, so it goes into the receiver's configuration now.
        messages.success(request, f"Saved webhook {hook.pk}. Its signing secret, shown only now: {secret}")
        return redirect("staff-alerts")
    month = period_key(Period.MONTH, timezone.now())
    shown = (
        Alert.objects.filter(period_key__startswith=month)
        .prefetch_related("deliveries__webhook__provider", "deliveries__webhook__team")
        .order_by("-created_at")[:ALERTS_SHOWN]
    )
    failing = (
        WebhookDelivery.objects.filter(sent_at__isnull=True, attempts__gt=0)
        .select_related("alert", "webhook__provider", "webhook__team")
        .order_by("-last_attempt_at")
    )
    context = {
        "alerts": shown,
        "failing_webhooks": failing,
        "failing_emails": Alert.objects.filter(sent_at__isnull=True).exclude(error="").order_by("-created_at")[:20],
        "webhooks": AlertWebhook.objects.select_related("provider", "team").order_by("id"),
        "form": form,
        "signature_header": SIGNATURE_HEADER,
        "delivery_header": DELIVERY_HEADER,
    }
    return render(request, "budgets/alerts.html", context)


@staff_required
def webhook_detail(request: HttpRequest, webhook_id: int) -> HttpResponse:
    """One webhook: its recent deliveries (GET); enable, disable or delete it (POST)."""
    hook = get_object_or_404(AlertWebhook.objects.select_related("provider", "team"), pk=webhook_id)
    if request.method == "POST":
        return _webhook_action(request, hook)
    deliveries = hook.deliveries.select_related("alert").order_by("-id")[:DELIVERIES_SHOWN]
    return render(request, "budgets/webhook_detail.html", {"hook": hook, "deliveries": deliveries})


def _webhook_action(request: HttpRequest, hook: AlertWebhook) -> HttpResponse:
    webhook_id, team_id = hook.pk, hook.team_id
    action = request.POST.get("action")
    if action == "delete":
        do_delete_webhook(request.user, hook)
        messages.success(request, f"Deleted webhook {webhook_id}.")
    elif action in ("enable", "disable"):
        do_set_webhook_enabled(request.user, hook, action == "enable")
        messages.success(request, f"Webhook {webhook_id} {action}d.")
    else:
        messages.error(request, "Unknown action.")
    # A team's webhook is managed on the team's page: back there.
    return redirect("staff-team", team_id) if team_id else redirect("staff-alerts")
