"""Create an API key for a user; the key is the last line of the output (scripts read it from there)."""

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser
from django.utils import timezone

from accounts.actions import MAX_LIFETIME_DAYS, do_create_api_key
from accounts.management.database import DatabaseCommand


class Command(DatabaseCommand):
    help = "Create an API key for USERNAME and print it (last line). It is shown only this once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="default", help="what the key is for (default: %(default)s)")
        parser.add_argument("--expires-in-days", type=int, default=None,
                            help=f"the key stops working after N days (1 to {MAX_LIFETIME_DAYS}; default: never)")

    def handle(self, *args, username: str, name: str, expires_in_days: int | None, **options) -> None:
        name = name.strip()
        if not 0 < len(name) <= 100:
            raise CommandError("--name must be 1 to 100 characters.")
        if expires_in_days is not None and not 1 <= expires_in_days <= MAX_LIFETIME_DAYS:
            raise CommandError(f"--expires-in-days must be 1 to {MAX_LIFETIME_DAYS}; leave it out for a key that never expires.")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"There is no user named {username!r}.")
        if not user.is_active:
            raise CommandError(f"The user {username!r} is deactivated; a key for them would not work.")
        expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        key, plaintext = do_create_api_key(user, name, expires_at=expires_at)
        until = f", valid until {expires_at:%Y-%m-%d %H:%M %Z}" if expires_at else ""
        self.stdout.write(f"Created the API key {key.name!r} for {username} ({key.prefix}…{until}). Store it now; it is not shown again:")
        self.stdout.write(plaintext)
