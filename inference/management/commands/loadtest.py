"""manage.py loadtest: hold many websocket clients open on a local Ceiling, some chatting; report as JSON."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.core.management.base import CommandError, CommandParser

from accounts.management.database import DatabaseCommand
from inference.tools.loadtest import LoadPlan, NotLoopback, run_load


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

    def handle(self, *args, **options) -> None:
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


def login_session(user) -> str:
    """A session for the user, as a login would make (the load test has no password to type)."""
    from importlib import import_module

    store = import_module(settings.SESSION_ENGINE).SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.create()
    return store.session_key
