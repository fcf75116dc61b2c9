"""Secrets Ceiling keeps for staff (a provider's API key): encrypted at rest with Fernet.

    seal("sk-...")      -> "gAAAAAB..."   (what the database holds)
    unseal("gAAAAAB...") -> "sk-..."      (only where the secret is used: the worker's HTTP call)

The key comes from CEILING_SECRETS_KEY, never from the database, so a dump of the database alone
gives nobody a provider's key. The setting is a comma-separated list of Fernet keys: the first
encrypts, every one decrypts (MultiFernet). To rotate, put a new key first, restart, run
`manage.py rotate_secrets` (re-encrypts every stored secret with the first key), then drop the old
key. A secret stored without the setting is refused with a sentence that says how to make a key.
"""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

SETTING = "CEILING_SECRETS_KEY"
HOW_TO_MAKE_A_KEY = (
    'python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
)


class SecretsUnavailable(RuntimeError):
    """No usable key: the sentence says what to set. Safe to show to staff (it holds no secret)."""


def _keys() -> list[str]:
    raw = getattr(settings, SETTING, "") or ""
    return [part.strip() for part in raw.split(",") if part.strip()]


def configured() -> bool:
    return bool(_keys())


def _fernet() -> MultiFernet:
    keys = _keys()
    if not keys:
        raise SecretsUnavailable(
            f"{SETTING} is not set on this server, so a secret cannot be stored encrypted or read back. "
            f"Make a key with {HOW_TO_MAKE_A_KEY} and set it in the environment of the web and worker processes."
        )
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except ValueError:
        raise SecretsUnavailable(
            f"{SETTING} holds something that is not a Fernet key (32 url-safe base64-encoded bytes); "
            f"make one with {HOW_TO_MAKE_A_KEY}."
        ) from None


def seal(plain: str) -> str:
    """The encrypted form of `plain`, as text for a database column."""
    return _fernet().encrypt(plain.encode()).decode()


def unseal(token: str) -> str:
    """The secret back; SecretsUnavailable when no configured key opens it (a key dropped too early)."""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretsUnavailable(
            f"a stored secret cannot be decrypted with any key in {SETTING}: the key it was stored with was "
            "removed or changed. Put that key back (after the new one), or enter the secret again."
        ) from None


def reseal(token: str) -> str:
    """The same secret encrypted with the first key (rotation); raises like unseal."""
    try:
        return _fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretsUnavailable(f"a stored secret cannot be decrypted with any key in {SETTING}") from None
