"""The wire protocol's events every stage of the pipeline may end a request with (docs/protocol.md)."""

from __future__ import annotations

TERMINAL = frozenset({"done", "refused", "error"})
LOGGED_EVENTS = TERMINAL | {"accepted"}  # one line each in the web process's log
INTERNAL_ERROR = {"type": "error", "code": "internal", "message": "Something went wrong on our side; please try again."}
DATABASE_UNAVAILABLE = {
    "type": "error", "code": "database_unavailable",
    "message": "The service cannot reach its database right now, so this request was not taken. Please try again in a minute.",
}
GUARD_UNAVAILABLE = "The budget guard cannot be reached right now, so no request can be admitted. Please try again in a minute."


def refused(code: str, message: str, retry_after_s: int | None = None, **numbers) -> dict:
    """A refusal: logged (by the stage that decided it) before it is yielded."""
    return {"type": "refused", "code": code, "message": message, "retry_after_s": retry_after_s, **numbers}


def error(code: str, message: str) -> dict:
    return {"type": "error", "code": code, "message": message}
