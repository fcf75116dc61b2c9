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


def tag_filter(tag: str) -> dict[str, str]:
    """The filter of a tag's ledger rows: `tags__contains` its ",name,", and `tags > ''`, which it
    implies, said outright so that PostgreSQL may use the trigram index, built only on the rows that
    carry tags (migration 0020: most rows carry none, and each would cost every write an entry)."""
    return {"tags__contains": tags_text([tag]), **TAGGED}


TAGGED = {"tags__gt": ""}  # "" sorts first in every collation: tags > '' ⇔ the row has tags
