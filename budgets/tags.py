"""Request tags: their names, and how a ledger row stores them. No Django models here, so the
frame parser (inference/web/frames.py) can use it without loading the apps."""

from __future__ import annotations

import re

TAG_RE = r"^[a-z0-9][a-z0-9_.:-]{0,31}$"
TAG_RULE = "1 to 32 lowercase letters, digits, '.', ':', '-' or '_', starting with a letter or digit"
MAX_TAGS = 8
_TAG = re.compile(TAG_RE)


def normalise_tag(raw: str) -> str:
    """A tag as typed, in the one spelling the ledger and the caps use: trimmed and lower-case.

    "Support", " support" and "support\n" are the tag "support": each spelling counted apart
    escaped the tag's cap.
    """
    return raw.strip().lower()


def is_tag(name: str) -> bool:
    """Whether `name` is a tag name, whole: fullmatch, since TAG_RE's "$" also matches before a
    final newline, which let "support\n" through as a tag of its own."""
    return _TAG.fullmatch(name) is not None


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
