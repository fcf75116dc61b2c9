"""Request tags: their names, and how a ledger row stores them. No Django models here, so the
frame parser (inference/web/frames.py) can use it without loading the apps."""

from __future__ import annotations

TAG_RE = r"^[a-z0-9][a-z0-9_.:-]{0,31}$"
TAG_RULE = "1 to 32 lowercase letters, digits, '.', ':', '-' or '_', starting with a letter or digit"
MAX_TAGS = 8


def tags_text(tags) -> str:
    """How a row stores its tags: ",support,beta," (a tag never holds a comma), "" for none.

    A filter on one tag is then `tags__contains=",support,"` on SQLite and PostgreSQL alike.
    """
    return f",{','.join(tags)}," if tags else ""
