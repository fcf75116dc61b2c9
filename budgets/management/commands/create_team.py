"""`manage.py create_team NAME [--member USERNAME ...]`: a team, and who is in it (who stay in any other team they are in)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser

from accounts.management.database import DatabaseCommand
from budgets.actions import do_create_team
from budgets.models import Team

COMMAND_LINE_ACTOR = None  # as set_quota: no person is logged in on the command line


class Command(DatabaseCommand):
    help = "Create a team; --member (repeatable) puts a user in it, out of any team they were in."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--member", action="append", default=[], metavar="USERNAME")

    def handle(self, *args, name: str, member: list[str], **options) -> None:
        name = name.strip()
        if not 0 < len(name) <= 64:
            raise CommandError("A team's name must be 1 to 64 characters.")
        if Team.objects.filter(name=name).exists():
            raise CommandError(f"There is already a team named {name!r}.")
        users = get_user_model().objects.filter(username__in=member)
        missing = sorted(set(member) - {user.get_username() for user in users})
        if missing:
            raise CommandError(f"There is no user named {', '.join(map(repr, missing))}.")
        team, _ = do_create_team(COMMAND_LINE_ACTOR, name, users)
        self.stdout.write(self.style.SUCCESS(f"team {team.name}: {len(users)} member(s)"))
