"""Calendar periods (minute, hour, day, month) in settings.TIME_ZONE, and how to say when one resets."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from django.conf import settings


def local_zone() -> ZoneInfo:
    return ZoneInfo(settings.TIME_ZONE)


# The last bounds computed per (period, zone): every admission asks for the same day and month
# several times (each ceiling's key and window), so most calls are one comparison.
_last_bounds: dict[tuple[str, str], tuple[datetime, datetime]] = {}


def period_bounds(period: str, at: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the day or month containing `at`, as aware datetimes in the local zone."""
    remembered = _last_bounds.get((period, settings.TIME_ZONE))
    if remembered is not None and at.tzinfo is not None and remembered[0] <= at < remembered[1]:
        return remembered
    bounds = _period_bounds(period, at)
    _last_bounds[(period, settings.TIME_ZONE)] = bounds
    return bounds


def _period_bounds(period: str, at: datetime) -> tuple[datetime, datetime]:
    local = at.astimezone(local_zone())
    if period == "minute":
        start = local.replace(second=0, microsecond=0)
        end = start + timedelta(minutes=1)
    elif period == "hour":
        start = local.replace(minute=0, second=0, microsecond=0)
        end = start + timedelta(hours=1)
    elif period == "day":
        start = local.replace(hour=0, minute=0, second=0, microsecond=0)
        end = _local_midnight(start.date() + timedelta(days=1))
    elif period == "month":
        start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        next_month = (start.replace(day=28) + timedelta(days=4)).replace(day=1)
        end = _local_midnight(next_month.date())
    else:
        raise ValueError(f"unknown period {period!r}")
    return start, end


def _local_midnight(day) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=local_zone())


KEY_FORMATS = {"minute": "%Y-%m-%dT%H:%M", "hour": "%Y-%m-%dT%H", "day": "%Y-%m-%d", "month": "%Y-%m"}


def period_key(period: str, at: datetime) -> str:
    start, _ = period_bounds(period, at)
    return start.strftime(KEY_FORMATS[period])


def seconds_until_reset(period: str, at: datetime) -> int:
    _, end = period_bounds(period, at)
    return max(1, int((end - at).total_seconds()) + 1)


def describe_reset(period: str, at: datetime) -> str:
    """'at 00:00 UTC, in 3 h 12 min' or 'on 1 January at 00:00 UTC, in 12 days 3 h'."""
    _, end = period_bounds(period, at)
    zone = end.strftime("%Z") or settings.TIME_ZONE
    left = int((end - at).total_seconds())
    if period == "minute":
        return f"in {max(1, left + 1)} s"
    if period == "hour":
        return f"at {end:%H:%M} {zone}, in {describe_duration(left)}"
    when = f"at {end:%H:%M} {zone}" if period == "day" else f"on {end.day} {end:%B} at {end:%H:%M} {zone}"
    return f"{when}, in {describe_duration(left)}"


def describe_duration(seconds: int) -> str:
    seconds = max(0, seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = max(1, rest // 60) if not days and not hours else rest // 60
    if days:
        return f"{days} day{'s' if days != 1 else ''} {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min"
