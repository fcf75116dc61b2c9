"""Log lines that name their request: a context variable, a filter that copies it onto every record,
and a formatter for one JSON object per line (CEILING_LOG_FORMAT=json).

    with request_context(request_id):      # the API view, the chat request, the Celery task
        log.info("...")                      # → {"ts": ..., "level": "INFO", ..., "request_id": "..."}

The id is the ledger's request_id: the HTTP API's x-request-id, the websocket's `accepted` frame,
the Celery task's argument. A context variable follows asyncio tasks and the thread that runs a
sync_to_async call, so the web side's lines carry it without passing it around; the worker sets it
again when its task starts, which is how one chat is followed from daphne to the worker and its settle.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

request_id_var: ContextVar[str] = ContextVar("ceiling_request_id", default="")


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (empty outside a request), for any formatter."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id_var.get()
        return True


class PlainFormatter(logging.Formatter):
    """The readable line, with `request_id=<id>` at its end while a request is being served."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", "") or request_id_var.get()
        if not request_id:
            return line
        # After the message's first line, so a traceback below it stays as Python wrote it.
        first, newline, rest = line.partition("\n")
        return f"{first} request_id={request_id}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, request_id when there is
    one, process, and the traceback as `exc` when the record has one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "") or request_id_var.get()
        if request_id:
            line["request_id"] = request_id
        line["process"] = record.process
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["exc"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)
