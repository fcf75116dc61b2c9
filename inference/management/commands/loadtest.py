"""manage.py loadtest: load on a Ceiling on this machine, with a JSON report. Two shapes:

    loadtest [--url URL] --connections 200 --chatting 50     many websockets to a running Ceiling
    loadtest --web 3 --workers 3 [--users 1000 ...]          a scale-out simulation it starts itself,
                                                             processes killed on the way (inference/tools/scaleout.py)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.core.management.base import CommandError, CommandParser

from accounts.management.database import DatabaseCommand
from inference.tools.loadtest import LoadPlan, NotLoopback, run_load
from inference.tools.scaleout import KILLABLE, ScalePlan, run_scaleout


class Command(DatabaseCommand):
    help = (
        "Open --connections websockets to a Ceiling on this machine, --chatting of them ask one short "
        "question each, probe an HTTP page and a websocket ping meanwhile, and write a JSON report. "
        "The chats run as --username (it must exist; seed_demo creates alice) and count in the ledger."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server, loopback only")
        parser.add_argument("--connections", type=int, default=200)
        parser.add_argument("--chatting", type=int, default=50)
        parser.add_argument("--max-tokens", type=int, default=16)
        parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole run")
        parser.add_argument("--handshakes-at-once", type=int, default=16, help="sockets opened concurrently")
        parser.add_argument("--username", default="alice")
        parser.add_argument("--feature", default="chat")
        parser.add_argument("--json", dest="json_path", default="", help="write the report here (else printed)")
        scale = parser.add_argument_group("scale-out simulation (--web and --workers start one on loopback)")
        scale.add_argument("--web", type=int, default=0, help="daphne processes to start")
        scale.add_argument("--workers", type=int, default=0, help="Celery workers to start")
        scale.add_argument("--users", type=int, default=ScalePlan.users)
        scale.add_argument("--requests", type=int, default=ScalePlan.requests)
        scale.add_argument("--concurrency", type=int, default=ScalePlan.concurrency, help="chats in flight at once")
        scale.add_argument("--user-cap", type=int, default=ScalePlan.user_cap, help="requests per user per day")
        scale.add_argument("--team-cap", type=int, default=ScalePlan.team_cap, help="requests per day of the team")
        scale.add_argument("--first-byte-ms", type=int, default=ScalePlan.first_byte_ms, help="the stub engine's TTFT")
        scale.add_argument("--token-ms", type=int, default=ScalePlan.token_ms, help="the stub engine's time per token")
        scale.add_argument("--kill", default=",".join(ScalePlan.kill),
                           help=f"what to SIGKILL during the run, comma-separated: {', '.join(KILLABLE)} (or none)")

    def handle(self, *args, **options) -> None:
        if options["web"] or options["workers"]:
            return self.scale_out(options)
        if min(options["connections"], options["max_tokens"], options["handshakes_at_once"]) < 1 or options["timeout"] <= 0:
            raise CommandError("--connections, --max-tokens, --handshakes-at-once and --timeout must be positive")
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user {options['username']!r}; create one (manage.py seed_demo creates alice)")
        try:
            plan = LoadPlan(
                options["url"], login_session(user), connections=options["connections"], chatting=options["chatting"],
                max_tokens=options["max_tokens"], timeout_s=options["timeout"], feature=options["feature"],
                handshakes_at_once=options["handshakes_at_once"],
            )
        except (NotLoopback, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        report = asyncio.run(run_load(plan))
        text = json.dumps(report, indent=2)
        if options["json_path"]:
            Path(options["json_path"]).write_text(text + "\n")
            chats = report["chats"]
            self.stdout.write(
                f"{report['connections']['opened']} sockets, {chats['sent']} chats: {chats['done']} done, "
                f"{chats['refused']} refused, {report['errors']} errors; report in {options['json_path']}"
            )
        else:
            self.stdout.write(text)


    def scale_out(self, options: dict) -> None:
        kill = tuple(k.strip() for k in options["kill"].split(",") if k.strip() and k.strip() != "none")
        plan = ScalePlan(
            web=options["web"], workers=options["workers"], users=options["users"], requests=options["requests"],
            concurrency=options["concurrency"], user_cap=options["user_cap"], team_cap=options["team_cap"],
            max_tokens=options["max_tokens"], first_byte_ms=options["first_byte_ms"], token_ms=options["token_ms"],
            kill=kill,
        )
        try:
            plan.check()
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        report = run_scaleout(plan, progress=self.stdout.write)
        text = json.dumps(report, indent=2)
        if options["json_path"]:
            Path(options["json_path"]).write_text(text + "\n")
        self.stdout.write(text)
        ledger, latency = report["ledger"], report["latency"]
        self.stdout.write(
            f"{ledger['admissions_per_s']} admissions/s, TTFT p50 {latency['ttft_p50_ms']} ms "
            f"(+{latency['added_ttft_p50_ms']} over the engine), overshoot {ledger['overshoot']}, "
            f"rows lost {ledger['rows_lost']}, unsettled {ledger['rows_unsettled']}, "
            f"counter mismatches {len(ledger['counter_mismatches'])}"
        )
        if not report["ok"]:
            raise CommandError("the scale-out run broke a ceiling or lost a row: see the report above")


def login_session(user) -> str:
    """A session for the user, as a login would make (the load test has no password to type)."""
    from importlib import import_module

    store = import_module(settings.SESSION_ENGINE).SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.create()
    return store.session_key
