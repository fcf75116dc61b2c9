"""Re-encrypt every stored secret with the first key of CEILING_SECRETS_KEY (after a rotation)."""

from __future__ import annotations

from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from budgets import vault
from budgets.models import Provider


class Command(DatabaseCommand):
    help = "Re-encrypt the providers' stored API keys with the first key in CEILING_SECRETS_KEY."

    def handle(self, *args, **options) -> None:
        done = 0
        for provider in Provider.objects.exclude(api_key_encrypted=""):
            try:
                sealed = vault.reseal(provider.api_key_encrypted)
            except vault.SecretsUnavailable as exc:
                raise CommandError(f"provider {provider.name!r}: {exc}") from None
            Provider.objects.filter(pk=provider.pk).update(api_key_encrypted=sealed)
            done += 1
        self.stdout.write(f"Re-encrypted {done} stored key(s) with the first key of CEILING_SECRETS_KEY.")
