"""Alert webhooks: one signed POST per alert and webhook, claimed once, retried until sent or given up.

    deliver_webhook(delivery_id)   # in the webhook task: claim, POST once, record the attempt

The body is JSON: Ceiling's own (every field of the alert, and its sentence as `text`) or, for
Slack-compatible receivers, `{"text": ...}` alone. Every POST carries

    X-Ceiling-Signature: sha256=<hex HMAC-SHA256 of the exact body bytes, keyed by the webhook's secret>
    X-Ceiling-Delivery: <delivery id>   (the same on every attempt: a receiver dedupes by it)

and the Standard Webhooks headers (standardwebhooks.com), whose signature also covers the id and
the moment, so a captured delivery cannot be replayed later as a new one:

    webhook-id: <delivery id>   webhook-timestamp: <Unix seconds of this attempt>
    webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}", keyed by the secret's bytes>

(A Standard Webhooks library takes the secret as "whsec_" + base64 of the secret's UTF-8 bytes.)
X-Ceiling-Signature stays for one release, for receivers that check it; new receivers should check
webhook-signature and refuse a timestamp more than 5 minutes away from their clock.

A receiver checks the signature before it believes anything in the body. Our side sends each
delivery until one attempt gets a 2xx; a receiver that took the POST but whose answer was lost
sees it again, with the same X-Ceiling-Delivery and webhook-id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time

from django.utils import timezone

from .actions import (
    WEBHOOK_FIRST_RETRY_S,
    WEBHOOK_MAX_ATTEMPTS,
    do_claim_delivery,
    do_finish_delivery,
    webhook_retry_countdown,
)
from .alerts import alert_email
from .models import Alert, AlertWebhook, WebhookDelivery
from .outbound import WEBHOOK, OutboundRefused, error_excerpt, policy_client

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Ceiling-Signature"
DELIVERY_HEADER = "X-Ceiling-Delivery"
MAX_ATTEMPTS = WEBHOOK_MAX_ATTEMPTS  # the first POST and five retries: 1, 2, 4, 8, 16 minutes apart
FIRST_RETRY_S = WEBHOOK_FIRST_RETRY_S
retry_countdown = webhook_retry_countdown
TIMEOUT_S = 10.0  # a receiver slower than this counts as failed and is tried again later
SECRET_BYTES = 32


class WebhookNotSent(RuntimeError):
    """One attempt failed; the claim is released so a retry can take it (unless `gave_up`).

    retry_in_s: when the next attempt is due, from the attempts the row counts (a chain of retries
    that a sweep started at attempt 3 waits 4 minutes, not the first retry's one).
    """

    def __init__(self, message: str, *, gave_up: bool, retry_in_s: int = FIRST_RETRY_S) -> None:
        super().__init__(message)
        self.gave_up = gave_up
        self.retry_in_s = retry_in_s


def new_secret() -> str:
    return secrets.token_urlsafe(SECRET_BYTES)


def sign(secret: str, body: bytes) -> str:
    """The X-Ceiling-Signature value for this body (the body alone: kept for one release)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def standard_signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The Standard Webhooks `webhook-signature` value: v1, then the base64 HMAC of id.timestamp.body."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, message_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    return {
        SIGNATURE_HEADER: sign(secret, body),
        DELIVERY_HEADER: message_id,
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": standard_signature(secret, message_id, timestamp, body),
    }


def webhook_body(alert: Alert, body_format: str) -> bytes:
    subject, text = alert_email(alert)
    if body_format == AlertWebhook.BodyFormat.SLACK:
        payload: dict = {"text": f"*{subject}*\n{text.strip()}"}
    else:
        payload = {
            "id": alert.id,
            "kind": alert.kind,
            "scope": alert.scope,
            "threshold_percent": alert.threshold,
            "period": alert.period_key,
            "spent_micro_usd": alert.spent_micro_usd,
            "limit_micro_usd": alert.limit_micro_usd,
            "projected_at": _iso(alert.projected_at),
            "period_end": _iso(alert.period_end),
            "created_at": _iso(alert.created_at),
            "subject": subject,
            "text": text.strip(),
        }
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def _iso(moment) -> str | None:
    return timezone.localtime(moment).isoformat(timespec="seconds") if moment else None


def deliver_webhook(delivery_id: int) -> bool:
    """Claim the delivery and POST it once. True when this call sent it.

    False when it was sent already, given up, disabled, or someone else holds the claim. Raises
    WebhookNotSent when the receiver failed (connection error, timeout, or a status other than 2xx).
    """
    delivery = do_claim_delivery(delivery_id)
    if delivery is None:
        return False
    hook = delivery.webhook
    if not hook.enabled:  # switched off after the alert was raised: nobody wants it there any more
        do_finish_delivery(delivery.id, status_code=None, error="webhook disabled", give_up=True)
        return False
    status_code, error = post(hook, delivery)
    if not error:
        do_finish_delivery(delivery.id, status_code=status_code)
        return True
    gave_up = delivery.attempts >= MAX_ATTEMPTS
    do_finish_delivery(delivery.id, status_code=status_code, error=error, give_up=gave_up)
    log.warning("webhook delivery %s, attempt %s: %s%s", delivery.id, delivery.attempts, error, " (giving up)" if gave_up else "")
    raise WebhookNotSent(f"delivery {delivery.id}: {error}", gave_up=gave_up,
                         retry_in_s=retry_countdown(max(0, delivery.attempts - 1)))


def post(hook: AlertWebhook, delivery: WebhookDelivery) -> tuple[int | None, str]:
    """(status code, error): error is "" for a 2xx answer."""
    body = webhook_body(delivery.alert, hook.body_format)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Ceiling-Alerts/1",
        **signed_headers(hook.secret, str(delivery.id), body),
    }
    try:
        # The outbound policy again at connect time (DNS may have changed since the save); no redirects.
        with policy_client(WEBHOOK, timeout=TIMEOUT_S) as client:
            response = client.post(hook.url, content=body, headers=headers)
    except OutboundRefused as exc:
        return None, f"refused by the outbound policy: {exc}"
    except Exception as exc:  # noqa: BLE001 - whatever broke, the claim must be released and the error shown
        return None, error_excerpt(f"{type(exc).__name__}: {exc}", 500)
    if 200 <= response.status_code < 300:
        return response.status_code, ""
    if 300 <= response.status_code < 400:
        return response.status_code, f"HTTP {response.status_code}: redirects are not followed ({error_excerpt(response.headers.get('location', ''))})"
    return response.status_code, f"HTTP {response.status_code}: {error_excerpt(response.text)}"
