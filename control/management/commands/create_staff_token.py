"""Create a staff API token for the management API; the token is the last line of the output."""

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser

from accounts.management.database import DatabaseCommand
from control.actions import do_create_staff_token


class Command(DatabaseCommand):
    help = "Create a staff API token (cst_…) for the staff user USERNAME and print it (last line), this once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", required=True, help="what the token is for, e.g. terraform")

    def handle(self, *args, username: str, name: str, **options) -> None:
        name = name.strip()
        if not 0 < len(name) <= 100:
            raise CommandError("--name must be 1 to 100 characters.")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"There is no user named {username!r}.")
        if not user.is_active or not user.is_staff:
            raise CommandError(f"The user {username!r} is not an active staff user; only their tokens work.")
        # No actor: a command run on the server is the operator's, as set_quota's changes are.
        token, plaintext = do_create_staff_token(None, user, name)
        self.stdout.write(f"Created the staff token {token.name!r} for {username} ({token.prefix}…). "
                          "Store it now; it is not shown again:")
        self.stdout.write(plaintext)
