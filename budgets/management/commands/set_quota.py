"""`manage.py set_quota (USERNAME | --default) --period day|month [--requests N] [--tokens N] [--cost-usd X] [--feature NAME]`"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import transaction

from accounts.management.database import DatabaseCommand
from budgets.actions import QUOTA_FIELDS, do_set_quota
from budgets.models import Feature, Period, Quota
from budgets.money import NegativeAmount, TooPrecise, parse_usd

# The audit trail's actor: no person is logged in on the command line, so the entry has none
# (the audit page shows "—"), exactly as AuditEntry.actor allows.
COMMAND_LINE_ACTOR = None


class Command(DatabaseCommand):
    help = "Set a cap for one user or for everyone (--default), per day or month, optionally per feature."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username", nargs="?")
        parser.add_argument("--default", action="store_true", help="the cap for everyone without their own")
        parser.add_argument("--period", required=True, choices=[p.value for p in Period])
        parser.add_argument("--requests", type=int)
        parser.add_argument("--tokens", type=int)
        parser.add_argument("--cost-usd", dest="cost_usd")
        parser.add_argument("--feature")
        parser.add_argument("--clear", action="store_true", help="remove this cap instead")

    def handle(self, *args, username=None, default=False, period, requests=None, tokens=None, cost_usd=None,
               feature=None, clear=False, **options) -> None:
        if bool(username) == bool(default):
            raise CommandError("Name exactly one user, or pass --default for everyone.")
        user = self._user(username) if username else None
        feature_obj = self._feature(feature) if feature else None
        scope = dict(user=user, feature=feature_obj, period=period)
        if clear:
            # Through do_set_quota like the dashboard, so the removal is in the audit trail too.
            with transaction.atomic():
                existed = Quota.objects.select_for_update().filter(**scope).exists()
                do_set_quota(COMMAND_LINE_ACTOR, caps=None, **scope)
            self.stdout.write(f"removed {int(existed)} cap(s)")
            return
        values = {
            "max_requests": _non_negative("--requests", requests),
            "max_tokens": _non_negative("--tokens", tokens),
            "max_cost_micro_usd": _micro_usd(cost_usd),
        }
        if all(v is None for v in values.values()):
            raise CommandError("Give at least one of --requests, --tokens, --cost-usd (or --clear).")
        with transaction.atomic():
            # A flag left out keeps the scope's current cap (do_set_quota replaces all three).
            current = Quota.objects.select_for_update().filter(**scope).first()
            caps = {name: getattr(current, name) if current else None for name in QUOTA_FIELDS}
            caps |= {name: value for name, value in values.items() if value is not None}
            do_set_quota(COMMAND_LINE_ACTOR, caps=caps, **scope)
        quota = Quota.objects.select_related("user", "feature").get(**scope)
        self.stdout.write(self.style.SUCCESS(f"{quota}: requests={quota.max_requests} tokens={quota.max_tokens} "
                                             f"cost_micro_usd={quota.max_cost_micro_usd}"))

    def _user(self, username: str):
        try:
            return get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"There is no user named {username!r}.") from None

    def _feature(self, name: str) -> Feature:
        try:
            return Feature.objects.get(name=name)
        except Feature.DoesNotExist:
            raise CommandError(f"There is no feature named {name!r}.") from None


def _non_negative(flag: str, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise CommandError(f"{flag} must be zero or more, not {value}.")
    return value


def _micro_usd(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return parse_usd(raw)
    except NegativeAmount:
        raise CommandError(f"--cost-usd must be zero or more, not {raw}.") from None
    except TooPrecise as exc:
        raise CommandError(f"--cost-usd: {exc}") from None
    except ValueError:
        raise CommandError(f"--cost-usd {raw!r} is not an amount in dollars.") from None
