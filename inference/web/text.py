"""What both the frame parser (frames.py) and the parameter parser (params.py) ask of client text."""

from __future__ import annotations


def storable(text: str) -> bool:
    """Text PostgreSQL can hold: no NUL, and no lone surrogate (JSON's "\\ud800" escapes allow both)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
