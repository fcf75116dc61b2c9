"""Rotate an API key: a new key (printed as the last line) with the old one's name, caps and features;
the old key keeps working for a grace period. Both changes are audited (actor "—", the command line)."""

from datetime import timedelta

from django.core.management.base import CommandError, CommandParser

from accounts.management.database import DatabaseCommand
from budgets.actions import MAX_GRACE_HOURS, KeyNotRotatable, do_rotate_api_key

COMMAND_LINE_ACTOR = None  # as set_quota: the audit trail shows "—"


class Command(DatabaseCommand):
    help = "Rotate the API key KEY_ID: print its replacement (last line); the old key works for --grace-hours more."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key_id", type=int)
        parser.add_argument("--grace-hours", type=int, default=24,
                            help=f"how long the old key keeps working, 0 to {MAX_GRACE_HOURS} (default: %(default)s)")

    def handle(self, *args, key_id: int, grace_hours: int, **options) -> None:
        if not 0 <= grace_hours <= MAX_GRACE_HOURS:
            raise CommandError(f"--grace-hours must be 0 to {MAX_GRACE_HOURS}.")
        try:
            new, plaintext = do_rotate_api_key(COMMAND_LINE_ACTOR, key_id, timedelta(hours=grace_hours))
        except KeyNotRotatable as exc:
            raise CommandError(str(exc)) from None
        old = new.rotated_from
        self.stdout.write(f"Rotated the API key {new.name!r} of {new.user.get_username()}: the old key ({old.prefix}…) "
                          f"works until {old.expires_at:%Y-%m-%d %H:%M %Z}. The new key ({new.prefix}…) is shown only this once:")
        self.stdout.write(plaintext)
