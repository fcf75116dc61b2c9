"""`manage.py set_quota (USERNAME | --default | --team NAME | --api-key ID | --tag NAME) --period minute|hour|day|month
[--requests N] [--tokens N] [--cost-usd X] [--feature NAME] [--clear]`
`manage.py set_quota (USERNAME | --default | --api-key ID) --in-flight N|none`

A user's and a team's caps are per minute, hour, day or month (requests, tokens, cost; all features
or one): minute and hour are windows against bursts. An API key carries
requests per day and cost per day and per month; a tag, cost per month. A user, everyone (the
default) and an API key may also cap their requests in flight at once (--in-flight; "none" removes it).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import transaction

from accounts.management.database import DatabaseCommand
from accounts.models import ApiKey
from budgets.actions import (
    QUOTA_FIELDS,
    do_set_in_flight_cap,
    do_set_key_caps,
    do_set_quota,
    do_set_tag_quota,
    do_set_team_quota,
)
from budgets.guard import in_flight_cap_of
from budgets.models import CALENDAR_PERIODS, Feature, Period, Quota, TagQuota, Team, TeamQuota
from budgets.money import NegativeAmount, TooPrecise, parse_usd
from budgets.tags import TAG_RULE, is_tag, normalise_tag

# The audit trail's actor: no person is logged in on the command line, so the entry has none
# (the audit page shows "—"), exactly as AuditEntry.actor allows.
COMMAND_LINE_ACTOR = None


class Command(DatabaseCommand):
    help = ("Set a cap for one user, everyone (--default), a team, an API key or a tag, per day or month, "
            "optionally per feature.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("username", nargs="?")
        parser.add_argument("--default", action="store_true", help="the cap for everyone without their own")
        parser.add_argument("--team", metavar="NAME", help="a team's cap: every member's requests count against it")
        parser.add_argument("--api-key", dest="api_key", type=int, metavar="ID",
                            help="an API key's own cap (requests per day, cost per day or month)")
        parser.add_argument("--tag", metavar="NAME", help="a tag's monthly spend cap, across every user")
        parser.add_argument("--period", choices=[p.value for p in Period])
        parser.add_argument("--in-flight", dest="in_flight", metavar="N|none",
                            help="requests admitted and not yet answered at once (a user, --default or --api-key)")
        parser.add_argument("--requests", type=int)
        parser.add_argument("--tokens", type=int)
        parser.add_argument("--cost-usd", dest="cost_usd")
        parser.add_argument("--feature")
        parser.add_argument("--clear", action="store_true", help="remove this cap instead")

    def handle(self, *args, username=None, default=False, team=None, api_key=None, tag=None, period=None,
               requests=None, tokens=None, cost_usd=None, feature=None, clear=False, in_flight=None, **options) -> None:
        named = [bool(username), bool(default), team is not None, api_key is not None, tag is not None]
        if sum(named) != 1:
            raise CommandError("Name exactly one user, or pass one of --default, --team, --api-key, --tag.")
        if in_flight is not None:
            if period or requests is not None or tokens is not None or cost_usd is not None or feature or clear:
                raise CommandError("--in-flight is set on its own: no --period, caps, --feature or --clear with it.")
            return self._in_flight(username, api_key, team, tag, _in_flight_value(in_flight))
        if period is None:
            raise CommandError("Give --period minute, hour, day or month (or --in-flight N).")
        if team is not None:
            return self._team(team, period, requests, tokens, cost_usd, feature, clear)
        if api_key is not None:
            return self._api_key(api_key, period, requests, tokens, cost_usd, feature, clear)
        if tag is not None:
            return self._tag(tag, period, requests, tokens, cost_usd, feature, clear)
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
            do_set_quota(COMMAND_LINE_ACTOR, caps=_kept_and_given(Quota, scope, values), **scope)
        self._report(Quota.objects.select_related("user", "feature").get(**scope))

    def _report(self, quota) -> None:
        self.stdout.write(self.style.SUCCESS(f"{quota}: requests={quota.max_requests} tokens={quota.max_tokens} "
                                             f"cost_micro_usd={quota.max_cost_micro_usd}"))

    def _team(self, name, period, requests, tokens, cost_usd, feature, clear) -> None:
        team = Team.objects.filter(name=name).first()
        if team is None:
            raise CommandError(f"There is no team named {name!r}.")
        scope = dict(team=team, feature=self._feature(feature) if feature else None, period=period)
        if clear:
            existed = TeamQuota.objects.filter(**scope).exists()
            do_set_team_quota(COMMAND_LINE_ACTOR, caps=None, **scope)
            self.stdout.write(f"removed {int(existed)} cap(s)")
            return
        values = _values(requests, tokens, cost_usd)
        with transaction.atomic():
            do_set_team_quota(COMMAND_LINE_ACTOR, caps=_kept_and_given(TeamQuota, scope, values), **scope)
        self._report(TeamQuota.objects.select_related("team", "feature").get(**scope))

    def _api_key(self, key_id, period, requests, tokens, cost_usd, feature, clear) -> None:
        key = ApiKey.objects.select_related("user").filter(pk=key_id).first()
        if key is None:
            raise CommandError(f"There is no API key with id {key_id}.")
        if tokens is not None or feature is not None:
            raise CommandError("An API key's caps are --requests (per day) and --cost-usd; not --tokens or --feature.")
        if period not in CALENDAR_PERIODS:
            raise CommandError("An API key's caps are per day or per month: use --period day or month.")
        if period == Period.MONTH and requests is not None:
            raise CommandError("An API key caps requests per day only; use --period day for --requests.")
        names = {"requests": "max_requests_per_day", "cost": f"max_cost_per_{period}_micro_usd"}
        if clear:
            caps = {names["cost"]: None} | ({names["requests"]: None} if period == Period.DAY else {})
        else:
            values = _values(requests, None, cost_usd)
            caps = {names["requests"]: values["max_requests"]} if values["max_requests"] is not None else {}
            if values["max_cost_micro_usd"] is not None:
                caps[names["cost"]] = values["max_cost_micro_usd"]
        do_set_key_caps(COMMAND_LINE_ACTOR, key, caps)
        self.stdout.write(self.style.SUCCESS(
            f"api key {key.pk} ({key.user.get_username()}/{key.name}): requests_per_day={key.max_requests_per_day} "
            f"cost_per_day_micro_usd={key.max_cost_per_day_micro_usd} "
            f"cost_per_month_micro_usd={key.max_cost_per_month_micro_usd}"
        ))

    def _in_flight(self, username, api_key, team, tag, value: int | None) -> None:
        if team is not None or tag is not None:
            raise CommandError("A cap on requests in flight is a user's, everyone's (--default) or an API key's.")
        if api_key is not None:
            key = ApiKey.objects.select_related("user").filter(pk=api_key).first()
            if key is None:
                raise CommandError(f"There is no API key with id {api_key}.")
            do_set_key_caps(COMMAND_LINE_ACTOR, key, {"max_in_flight": value})
            self.stdout.write(self.style.SUCCESS(
                f"api key {key.pk} ({key.user.get_username()}/{key.name}): max_in_flight={key.max_in_flight}"))
            return
        user = self._user(username) if username else None
        do_set_in_flight_cap(COMMAND_LINE_ACTOR, user, value)
        who = user.get_username() if user else "default"
        in_force = in_flight_cap_of(user.pk) if user else value
        self.stdout.write(self.style.SUCCESS(f"{who}: max_in_flight={value} (in force: {in_force})"))

    def _tag(self, tag, period, requests, tokens, cost_usd, feature, clear) -> None:
        tag = normalise_tag(tag)
        if not is_tag(tag):
            raise CommandError(f"{tag!r} is not a tag name: {TAG_RULE}.")
        if period != Period.MONTH:
            raise CommandError("A tag's cap is per month: use --period month.")
        if requests is not None or tokens is not None or feature is not None:
            raise CommandError("A tag's cap is --cost-usd only (per month).")
        if clear:
            existed = TagQuota.objects.filter(tag=tag).exists()
            do_set_tag_quota(COMMAND_LINE_ACTOR, tag, None)
            self.stdout.write(f"removed {int(existed)} cap(s)")
            return
        cost = _micro_usd(cost_usd)
        if cost is None:
            raise CommandError("Give --cost-usd (or --clear).")
        do_set_tag_quota(COMMAND_LINE_ACTOR, tag, cost)
        self.stdout.write(self.style.SUCCESS(f"tag {tag} / month: cost_micro_usd={cost}"))

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


def _values(requests, tokens, cost_usd) -> dict[str, int | None]:
    values = {
        "max_requests": _non_negative("--requests", requests),
        "max_tokens": _non_negative("--tokens", tokens),
        "max_cost_micro_usd": _micro_usd(cost_usd),
    }
    if all(v is None for v in values.values()):
        raise CommandError("Give at least one of --requests, --tokens, --cost-usd (or --clear).")
    return values


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


def _kept_and_given(model, scope: dict, values: dict) -> dict:
    """The scope's caps after this command: a flag left out keeps the current cap (the do_* action
    replaces all three). Call inside a transaction: the row is locked until the action has run."""
    current = model.objects.select_for_update().filter(**scope).first()
    caps = {name: getattr(current, name) if current else None for name in QUOTA_FIELDS}
    return caps | {name: value for name, value in values.items() if value is not None}


def _in_flight_value(text: str) -> int | None:
    """--in-flight: a whole number of requests, at least 1 (0 would refuse everything), or "none"."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"--in-flight takes a whole number of requests or 'none', not {text!r}.") from None
    if value < 1:
        raise CommandError("--in-flight must be at least 1 (to stop a user, deactivate them or set a cap of 0 requests).")
    return value
