"""The suite's password hasher: Django's PBKDF2 with few iterations.

Every test that makes alice, bob or staff hashes a password, and every failed login in a throttling
test hashes one more: at Django's 1,000,000 iterations that is a few tenths of a second each on a
2-core machine, minutes over the suite (Django's testing docs suggest a faster hasher for this).
Its hashes are ordinary `pbkdf2_sha256$<iterations>$…` ones, so a stack's daphne, on the real
hasher, checks them as it checks any other, and re-hashes at full strength when that user logs
in through it (Django's upgrade of an outdated hash). Only the test process uses it
(tests/conftest.py); the settings and the stack's processes are untouched.
"""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1_000
