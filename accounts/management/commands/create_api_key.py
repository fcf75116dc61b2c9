"""Create an API key for a user; the key is the last line of the output (scripts read it from there)."""

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser

from accounts.actions import do_create_api_key
from accounts.management.database import DatabaseCommand


class Command(DatabaseCommand):
    help = "Create an API key for USERNAME and print it (last line). It is shown only this once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="default", help="what the key is for (default: %(default)s)")

    def handle(self, *args, username: str, name: str, **options) -> None:
        name = name.strip()
        if not 0 < len(name) <= 100:
            raise CommandError("--name must be 1 to 100 characters.")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"There is no user named {username!r}.")
        if not user.is_active:
            raise CommandError(f"The user {username!r} is deactivated; a key for them would not work.")
        key, plaintext = do_create_api_key(user, name)
        self.stdout.write(f"Created the API key {key.name!r} for {username} ({key.prefix}…). Store it now; it is not shown again:")
        self.stdout.write(plaintext)
