"""Idempotent demo data: the staff user `staff`, the end user `alice` and the feature `chat`.

Here rather than in accounts because it creates a Feature: budgets may import accounts, never the
other way round (tests/test_layering.py).
"""

import os
import secrets

from django.contrib.auth import get_user_model

from accounts.management.database import DatabaseCommand
from budgets.models import Feature

DEMO_USERS = (("staff", True), ("alice", False))


class Command(DatabaseCommand):
    help = "Create the demo users (staff, alice) and the chat feature; prints new passwords once."

    def handle(self, *args, **options) -> None:
        Feature.objects.get_or_create(name="chat", defaults={"description": "Chat with the model"})
        User = get_user_model()
        password = os.environ.get("CEILING_DEMO_PASSWORD", "")
        for username, is_staff in DEMO_USERS:
            user, created = User.objects.get_or_create(username=username, defaults={"is_staff": is_staff})
            if not created:
                self.stdout.write(f"user {username!r} exists; password unchanged")
                continue
            chosen = password or secrets.token_urlsafe(9)
            user.set_password(chosen)
            user.save(update_fields=["password"])
            role = "staff" if is_staff else "end user"
            self.stdout.write(self.style.SUCCESS(f"created {role} {username!r} with password {chosen}"))
