"""`manage.py seed_demo [--no-history]`: idempotent demo data that shows the ceiling on first load.

- the staff user `staff` and the end user `alice` (passwords printed once), the feature `chat`, and
  the feature `docs` (answers from documents; `load_docs` loads Ceiling's docs/ into it);
- alice's daily caps, small enough that a few chats reach them;
- the local provider at a realistic hourly cost with a monthly limit, so its tokens are priced
  (budgets/selfhosted.py) and its spend has a ceiling;
- unless --no-history, 30 days of synthetic traffic from a few hundred users (synth_logs), so every
  chart, the cost per user page and the cost model's "use real history" have data.

Run again, it changes nothing that exists: users keep their passwords, caps and provider settings
staff changed stay, history is added only when there is none. Here rather than in accounts because
it creates budgets' rows: budgets may import accounts, never the other way round.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from accounts.management.database import DatabaseCommand
from budgets.actions import do_price_local_tokens, do_save_with_audit, do_set_quota, snapshot
from budgets.models import Feature, ModelPrice, Period, Provider, Quota, TokenLog
from budgets.money import format_usd

from .synth_logs import PREFIX as SYNTHETIC_PREFIX

DEMO_USERS = (("staff", True), ("alice", False))
DOCS_DESCRIPTION = "Questions about Ceiling, answered from its documentation"
# No person runs this: the audit trail's entries have no actor, as with set_quota.
COMMAND_LINE_ACTOR = None
# A few chats of a few hundred tokens each reach these (the refusal and its reset time show).
ALICE_DAILY_CAPS = {"max_requests": 20, "max_tokens": 20_000, "max_cost_micro_usd": None}
# A small 2-vCPU cloud machine, what the default CPU engine runs on; staff change it on its page.
LOCAL_HOURLY_COST_MICRO_USD = 100_000  # $0.10 per hour
LOCAL_UTILISATION_PERCENT = 70
LOCAL_MONTHLY_LIMIT_MICRO_USD = 5_000_000  # $5
LOCAL_ALERT_THRESHOLDS = [50, 80, 100]
# Assumed until a worker reports its engine's measured rates: the official CPU bench's engine run
# (docs/bench-cpu.json, 78.88 output tokens/s on 2 cores) and its prefill rate (docs/engine.md).
ASSUMED_DECODE_TOKENS_PER_S = 79.0
ASSUMED_PREFILL_TOKENS_PER_S = 350.0
# The demo features' generation default: greedy decoding with a frequency penalty. SmolLM2-135M loops
# greedily ("The cap is set by the team's cap." eight times over); on 8 chat and docs questions at 256
# tokens, 3 answers repeated a sentence greedily, 0 with this penalty, 1 with the model card's sampling
# (temperature 0.2, top_p 0.9), which is also not reproducible and so never cached (docs/configuration.md).
DEMO_FREQUENCY_PENALTY = 0.5
HISTORY_DAYS = 30
HISTORY_USERS = 300
HISTORY_ROWS = 20_000  # about two requests per synthetic user per day, long-tailed: a few seconds


class Command(DatabaseCommand):
    help = ("Create the demo users (staff, alice), alice's daily caps, the priced local provider and "
            "(unless --no-history) 30 days of synthetic traffic; prints new passwords once.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--no-history", action="store_true", help="no synthetic traffic")

    def handle(self, *args, no_history: bool = False, **options) -> None:
        generation = {"frequency_penalty": DEMO_FREQUENCY_PENALTY}
        Feature.objects.get_or_create(name="chat", defaults={"description": "Chat with the model", **generation})
        # Its documents (Ceiling's own docs/) are loaded by `manage.py load_docs`, which `make run`
        # runs next: chunking and embedding belong to inference, which budgets never imports.
        Feature.objects.get_or_create(name="docs", defaults={"description": DOCS_DESCRIPTION, "mode": Feature.Mode.DOCS,
                                                             **generation})
        users = self._users()
        self._alice_caps(users["alice"])
        provider = self._local_provider()
        if not no_history:
            self._history(provider)

    def _users(self) -> dict:
        User = get_user_model()
        password = os.environ.get("CEILING_DEMO_PASSWORD", "")
        users = {}
        for username, is_staff in DEMO_USERS:
            user, created = User.objects.get_or_create(username=username, defaults={"is_staff": is_staff})
            users[username] = user
            if not created:
                self.stdout.write(f"user {username!r} exists; password unchanged")
                continue
            chosen = password or secrets.token_urlsafe(9)
            user.set_password(chosen)
            user.save(update_fields=["password"])
            role = "staff" if is_staff else "end user"
            self.stdout.write(self.style.SUCCESS(f"created {role} {username!r} with password {chosen}"))
        return users

    def _alice_caps(self, alice) -> None:
        if Quota.objects.filter(user=alice, feature__isnull=True, period=Period.DAY).exists():
            self.stdout.write("alice has daily caps; unchanged")
            return
        do_set_quota(COMMAND_LINE_ACTOR, user=alice, feature=None, period=Period.DAY, caps=ALICE_DAILY_CAPS)
        self.stdout.write(f"alice: at most {ALICE_DAILY_CAPS['max_requests']} requests and "
                          f"{ALICE_DAILY_CAPS['max_tokens']:,} tokens a day")

    def _local_provider(self) -> Provider:
        """Fill in what the local provider lacks; what staff set stays."""
        provider = Provider.default()
        model = settings.CEILING_MODEL_NAME
        fields = ("monthly_limit_micro_usd", "alert_thresholds", "hourly_cost_micro_usd", "utilisation_percent")
        before = snapshot(provider, fields)
        with transaction.atomic():
            if provider.hourly_cost_micro_usd is None:
                provider.hourly_cost_micro_usd = LOCAL_HOURLY_COST_MICRO_USD
                provider.utilisation_percent = LOCAL_UTILISATION_PERCENT
            if provider.monthly_limit_micro_usd is None:
                provider.monthly_limit_micro_usd = LOCAL_MONTHLY_LIMIT_MICRO_USD
                provider.alert_thresholds = LOCAL_ALERT_THRESHOLDS
            if provider.decode_tokens_per_s is None:
                # Not a measurement (throughput_measured_at stays empty): the first real one replaces it.
                Provider.objects.filter(pk=provider.pk).update(
                    decode_tokens_per_s=ASSUMED_DECODE_TOKENS_PER_S, prefill_tokens_per_s=ASSUMED_PREFILL_TOKENS_PER_S
                )
                provider.decode_tokens_per_s = ASSUMED_DECODE_TOKENS_PER_S
                provider.prefill_tokens_per_s = ASSUMED_PREFILL_TOKENS_PER_S
            # Not do_save_provider: that would price from now, and the price is dated below.
            do_save_with_audit(COMMAND_LINE_ACTOR, provider, fields, before, target=f"provider {provider.name}")
            # The first local price takes effect where the history starts, so its rows are costed at it.
            first = not ModelPrice.objects.filter(provider=provider, model=model).exists()
            at = timezone.now() - timedelta(days=HISTORY_DAYS) if first else None
            do_price_local_tokens(COMMAND_LINE_ACTOR, provider, model, at=at)
        price = ModelPrice.objects.filter(provider=provider, model=model).order_by("-effective_from").first()
        limit = format_usd(provider.monthly_limit_micro_usd) if provider.monthly_limit_micro_usd else "no limit"
        self.stdout.write(f"provider 'local': {format_usd(provider.hourly_cost_micro_usd or 0)}/h, monthly limit {limit}"
                          + (f"; {model} at {price}, {price.basis or price.get_source_display()}" if price else ""))
        return provider

    def _history(self, provider: Provider) -> None:
        if TokenLog.objects.filter(request_id__startswith=SYNTHETIC_PREFIX).exists():
            self.stdout.write("synthetic history exists; unchanged (synth_logs --clear removes it)")
            return
        call_command("synth_logs", rows=HISTORY_ROWS, users=HISTORY_USERS, days=HISTORY_DAYS, stdout=self.stdout)
