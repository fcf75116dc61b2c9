"""Run admissions from a separate process: `python -m tests.guard_load USER_ID FEATURE_ID COUNT THREADS PROMPT MAX [FALLBACK_ID]`.

Prints one JSON line {"admitted": n, "refused": n, "codes": {...}}. Used by the guard tests to
hit the same caps from several processes at once (DATABASE_URL / REDIS_URL come from the caller).
With FALLBACK_ID, each request may fall back to that feature; a fallback counts as "fell_back".
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor


def main(user_id: int, feature_id: int, count: int, threads: int, prompt: int, max_tokens: int,
         fallback_id: int | None = None) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.db import connection

    from budgets.guard import AdmissionRequest, Fallback, admit
    from budgets.models import Feature

    user, feature = User.objects.get(pk=user_id), Feature.objects.get(pk=feature_id)
    fallback = Fallback(Feature.objects.get(pk=fallback_id), "test-model", max_tokens) if fallback_id else None

    def one(_: int) -> str:
        try:
            request = AdmissionRequest(uuid.uuid4().hex, user, feature, "test-model", prompt, max_tokens, fallback=fallback)
            decision = admit(request)
            if decision.fell_back_to is not None:
                return "fell_back"
            return "admitted" if decision.admitted else decision.code
        finally:
            connection.close()

    with ThreadPoolExecutor(threads) as pool:
        outcomes = Counter(pool.map(one, range(count)))
    admitted = outcomes.pop("admitted", 0)
    fell_back = outcomes.pop("fell_back", 0)
    return {"admitted": admitted, "fell_back": fell_back, "refused": sum(outcomes.values()), "codes": dict(outcomes)}


if __name__ == "__main__":
    print(json.dumps(main(*(int(arg) for arg in sys.argv[1:8]))))
