"""Parse intervals and rates into integer microseconds, and format them back.

Accepted: ``float``/``int`` seconds, :class:`datetime.timedelta`, a number with a unit
(``"1500us"``, ``"200ms"``, ``"2s"``, ``"1.5m"``, ``"1h"``, ``"1d"``), and rates: a count per
period of the same units (``"5/s"``, ``"300/m"``, ``"1000/h"``, ``"10/2s"``, ``"2/100ms"``,
``"1/d"``; one start per ``1/rate``: "10 per 2 s" is one start every 200 ms, never more than
10 in any 2 s). The store keeps microseconds (not milliseconds) so that a 2 ms cap is a 2 ms cap
and not "anything that rounds to 2 ms".
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import TypeAlias

from .errors import InvalidIntervalError

IntervalLike: TypeAlias = int | float | str | timedelta

US_PER_S = 1_000_000
MIN_INTERVAL_US = 1_000  # 1 ms: below it a store round trip is a large share of the interval
MAX_INTERVAL_US = 86_400 * US_PER_S  # one day
#: The longest back-off: a hold whose end is further off is a mistake (a misread header).
MAX_BACKOFF_US = 86_400 * US_PER_S

#: The units of durations and of rates' periods alike.
_UNITS_US = {
    "us": 1, "µs": 1, "ms": 1_000, "s": US_PER_S, "sec": US_PER_S,
    "m": 60 * US_PER_S, "min": 60 * US_PER_S, "h": 3_600 * US_PER_S, "d": 86_400 * US_PER_S,
}  # fmt: skip
_UNIT = r"(us|µs|ms|sec|min|s|m|h|d)"  # longest first where one is the other's prefix
_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_DURATION = re.compile(rf"^\s*{_NUMBER}\s*{_UNIT}?\s*$")
_RATE = re.compile(rf"^\s*{_NUMBER}\s*/\s*{_NUMBER}?\s*{_UNIT}\s*$")
_INTERVAL_FORMS = "'200ms', '2s', '1.5m', '1h', '1d', '1500us' or a rate like '5/s', '300/m', '1000/h', '10/2s'"
_DURATION_FORMS = "'30s', '2m', '1h', '500ms' or '1d'"


def parse_interval(value: IntervalLike) -> int:
    """Return ``value`` as whole microseconds, or raise :class:`InvalidIntervalError`.

    A bare number is seconds. Accepts 1 ms to 1 day.
    """
    if isinstance(value, bool):  # bool is an int; True seconds is surely a mistake
        raise InvalidIntervalError(f"interval {value!r} is a boolean, not a duration")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = _float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value)
    else:
        raise InvalidIntervalError(
            f"interval {value!r} has type {type(value).__name__}; use seconds, a timedelta, "
            f"'200ms', '2s', '1.5m' or a rate like '5/s'"
        )
    return _checked(value, seconds)


def parse_duration(value: IntervalLike) -> int:
    """A non-negative duration (a tolerance, a grace period) in whole microseconds: the
    forms :func:`parse_interval` takes, without its 1 ms to 1 day range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, timedelta)):
        raise InvalidIntervalError(f"duration {value!r} must be seconds, a timedelta, or text like '1ms'")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str):
        seconds = _parse_text(value, "duration", _DURATION_FORMS)
    else:
        seconds = _float(value)
    if seconds < 0:
        raise InvalidIntervalError(
            f"duration {value!r} is negative: give a duration of 0 or more, like {_DURATION_FORMS}"
        )
    if math.isnan(seconds) or math.isinf(seconds * US_PER_S):
        raise InvalidIntervalError(f"duration {value!r} must be a finite number of seconds >= 0")
    return round(seconds * US_PER_S)


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond any float: as long as infinity
        return math.inf if value > 0 else -math.inf


def _parse_text(text: str, what: str = "interval", forms: str = _INTERVAL_FORMS) -> float:
    if m := _RATE.match(text):
        count = float(m.group(1))
        if count <= 0:
            raise InvalidIntervalError(f"rate {text!r} must allow at least some starts: its count must be positive")
        periods = float(m.group(2)) if m.group(2) else 1.0  # "10/2s": 10 per 2 seconds
        if periods <= 0:
            raise InvalidIntervalError(f"rate {text!r} has a period of {m.group(2)}: the period must be positive")
        return periods * _UNITS_US[m.group(3)] / US_PER_S / count
    if m := _DURATION.match(text):
        unit = m.group(2) or "s"
        return float(m.group(1)) * _UNITS_US[unit] / US_PER_S
    raise InvalidIntervalError(f"cannot parse {what} {text!r}; write it like {forms}")


def _checked(original: object, seconds: float) -> int:
    if math.isnan(seconds) or math.isinf(seconds * US_PER_S):
        raise InvalidIntervalError(f"interval {original!r} is not a finite duration")
    us = round(seconds * US_PER_S)
    if seconds <= 0:
        raise InvalidIntervalError(f"interval {original!r} must be positive: the minimum is 1 ms")
    if us < MIN_INTERVAL_US:
        raise InvalidIntervalError(
            f"interval {original!r} is below the minimum of 1 ms (at most 1000 starts per second)"
        )
    if us > MAX_INTERVAL_US:
        raise InvalidIntervalError(f"interval {original!r} is longer than the maximum of one day")
    return us


def format_interval(us: int) -> str:
    """Format microseconds the way users write intervals: ``200ms``, ``2s``, ``1.5m``."""
    if us % 3_600_000_000 == 0:
        return f"{us // 3_600_000_000}h"
    if us >= 60 * US_PER_S and us % (6 * US_PER_S) == 0:
        return f"{us / (60 * US_PER_S):g}m"
    if us >= US_PER_S:
        text = f"{us / US_PER_S:g}s"  # 6 significant digits: exact only if it parses back
        if parse_interval(text) == us:
            return text
    if us % 1_000 == 0:
        return f"{us // 1_000}ms"
    return f"{us / 1_000:g}ms" if us < US_PER_S else f"{us}us"
