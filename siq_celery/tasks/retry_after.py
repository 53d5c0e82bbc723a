"""How long a service asked to be left alone, read from its answer: ``siq_backoff(response)``.

A service that says "too many requests" says when to come back in one of three headers,
each in units of its own. Reading them here, once, keeps a task from holding its whole
queue, on every worker, for zero seconds or for years because it misread one (a Unix
time taken for a delay, a date for garbage). Pure: no I/O, the clock is a parameter.

The first of these headers present decides; an unreadable one is an error, not skipped
(falling through to the next would hide what the service actually said):

1. ``Retry-After`` (RFC 9110 §10.2.3): delta-seconds, or an HTTP-date (the time from now
   until then).
2. ``RateLimit-Reset`` (IETF draft httpapi-ratelimit-headers): delta-seconds.
3. ``X-RateLimit-Reset`` (GitHub, Twitter, Discord, ... each its own way): a number below
   10**9 is delta-seconds (10**9 s is 31 years: nobody means a delay that long), below
   10**12 a Unix time in seconds (10**9 is 2001-09-09), from 10**12 a Unix time in
   milliseconds.

A moment already past is a hold of 0 (come back now). A hold over one day (the most a
back-off holds, :data:`~siq_celery.intervals.MAX_BACKOFF_US`), a negative number, NaN or
anything else unreadable is a one-line :class:`ConfigurationError` naming the header and
its value (:func:`hold_from`). Header names are matched whatever their case, whatever the
mapping does.

``siq_backoff`` itself never fails on what a service said (:func:`backoff_hold`): a 429 is
the one moment the task must not fail, so a response with no header, or one it cannot
read, holds the queue for ``default=`` if given, else ``siq_backoff_default``
(:data:`DEFAULT_BACKOFF_S`), and the worker logs one warning naming the header and value.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from datetime import UTC, timedelta
from email.utils import parsedate_to_datetime
from typing import Protocol, TypeAlias, runtime_checkable

from ..errors import ConfigurationError
from ..intervals import MAX_BACKOFF_US, US_PER_S, IntervalLike

RETRY_AFTER = "Retry-After"
RATELIMIT_RESET = "RateLimit-Reset"
X_RATELIMIT_RESET = "X-RateLimit-Reset"
#: The headers read, in order of precedence.
HEADERS = (RETRY_AFTER, RATELIMIT_RESET, X_RATELIMIT_RESET)
#: X-RateLimit-Reset from this value on is a Unix time in seconds, not a delay ...
EPOCH_S_FROM = 10**9
#: ... and from this one on a Unix time in milliseconds.
EPOCH_MS_FROM = 10**12
MAX_HOLD_S = MAX_BACKOFF_US / US_PER_S
#: ``siq_backoff_default``: the hold of a response that says nothing readable about when
#: to come back. A minute: the window of most services' limits (per minute), and what
#: GitHub asks of a client told nothing; a second would ask again into the same window.
DEFAULT_BACKOFF_S = 60.0

# Digits, a fraction, a sign: no exponent, no "nan" or "inf", no "1_000" (float() takes them all).
_NUMBER = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$")


@runtime_checkable
class HeaderItems(Protocol):
    """Headers: a Mapping (a dict, requests' CaseInsensitiveDict, httpx.Headers, aiohttp's
    CIMultiDictProxy) or anything else with ``items()`` (http.client's HTTPMessage)."""

    def items(self) -> Iterable[tuple[str, str]]: ...


@runtime_checkable
class HasHeaders(Protocol):
    """A response (requests, httpx, aiohttp, urllib), or an error carrying the headers of
    one (urllib's HTTPError)."""

    @property
    def headers(self) -> HeaderItems: ...


BackoffSource: TypeAlias = IntervalLike | HeaderItems | HasHeaders


def hold_from(
    source: BackoffSource, *, default: IntervalLike | None = None, now: Callable[[], float] = time.time
) -> IntervalLike:
    """The hold ``siq_backoff(source)`` asks for.

    Seconds (a number, text like ``"30s"``, a timedelta) come back as given: the queue
    validates them as it always did. A response, or its headers, gives float seconds from
    ``now()`` (Unix seconds) within [0, one day], rounded to the millisecond; ``default`` if
    it has none of :data:`HEADERS`, else a ConfigurationError."""
    if isinstance(source, (int, float, str, timedelta)):
        return source
    found = first_header(_headers_of(source))
    if found is None:
        if default is not None:
            return default
        raise ConfigurationError(
            f"cannot back off from {type(source).__name__}: it has none of the headers "
            f"{', '.join(HEADERS)}; give the seconds, or default=SECONDS"
        )
    name, value = found
    return round(seconds_of(name, value, now()), 3)


def backoff_hold(
    source: BackoffSource, *, default: IntervalLike | None = None, fallback: IntervalLike = DEFAULT_BACKOFF_S,
    now: Callable[[], float] = time.time,
) -> tuple[IntervalLike, str | None]:  # fmt: skip
    """``siq_backoff(source)``'s hold, and why it is not the one the response asked for.

    :func:`hold_from`'s, except that a response (or headers) with none of :data:`HEADERS`,
    or whose header cannot be read or asks for more than a day, holds ``default`` if given,
    else ``fallback`` (``siq_backoff_default``). The second item is then one line for a
    warning, naming the header and its value (or saying none was there); None when the
    hold was read, or when ``default`` stood in for absent headers, as the caller asked.
    Anything that is neither seconds nor a response is still a ConfigurationError."""
    if isinstance(source, (int, float, str, timedelta)):
        return source, None
    found = first_header(_headers_of(source))
    if found is None:
        if default is not None:
            return default, None
        return fallback, f"{type(source).__name__} has none of the headers {', '.join(HEADERS)}"
    name, value = found
    try:
        return round(seconds_of(name, value, now()), 3), None
    except ConfigurationError as exc:
        return (default if default is not None else fallback), str(exc)


def _headers_of(source: HeaderItems | HasHeaders) -> HeaderItems:
    """``source.headers``, or ``source`` itself: headers given as they are."""
    headers = source.headers if isinstance(source, HasHeaders) else source
    if not isinstance(headers, HeaderItems):
        raise ConfigurationError(
            f"a back-off is seconds ('30s', a timedelta), a response or its headers, not {source!r:.80}"
        )
    return headers


def first_header(headers: HeaderItems) -> tuple[str, str] | None:
    """The first of :data:`HEADERS` in ``headers`` and its value (of a repeated header, the
    first), the name matched in any case: a plain dict is case-sensitive, HTTP is not."""
    wanted = {name.lower(): name for name in HEADERS}
    found: dict[str, str] = {}
    for key, value in headers.items():
        name = wanted.get(str(key).lower())
        if name is not None and name not in found:
            found[name] = str(value)
    return next(((name, found[name]) for name in HEADERS if name in found), None)


def seconds_of(name: str, value: str, now: float) -> float:
    """The hold header ``name`` asks for with ``value``, ``now`` being Unix seconds: at
    least 0, at most one day, else a ConfigurationError."""
    text = value.strip()
    if name == RETRY_AFTER and not _NUMBER.match(text):
        seconds = _until_date(name, value, now)
    else:
        seconds = _number(name, value)
        if name == X_RATELIMIT_RESET:
            seconds = _reset(seconds, now)
    if not seconds <= MAX_HOLD_S:  # also NaN
        raise ConfigurationError(
            f"cannot back off from {name}: {_shown(value)}: a hold of {seconds:.0f} s is over one day, "
            f"the most a back-off holds"
        )
    return max(seconds, 0.0)


def _number(name: str, value: str) -> float:
    """Delta-seconds (a fraction allowed: some services send one), at least 0."""
    text = value.strip()
    if not _NUMBER.match(text):
        what = "delta-seconds or an HTTP-date" if name == RETRY_AFTER else "a number of seconds"
        raise ConfigurationError(f"cannot back off from {name}: {_shown(value)} is not {what}")
    seconds = float(text)  # digits beyond any float: infinity, over the cap
    if seconds < 0:
        raise ConfigurationError(f"cannot back off from {name}: {_shown(value)} is negative")
    return seconds


def _reset(number: float, now: float) -> float:
    """X-RateLimit-Reset's ``number``: delta-seconds, or a Unix time in seconds or in
    milliseconds, told apart by size (the module's rule)."""
    if number < EPOCH_S_FROM:
        return number
    if number < EPOCH_MS_FROM:
        return number - now
    return number / 1000 - now


def _until_date(name: str, value: str, now: float) -> float:
    """Seconds from ``now`` until Retry-After's HTTP-date (GMT, as RFC 9110 has it, when
    the date names no zone)."""
    try:
        date = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        raise ConfigurationError(
            f"cannot back off from {name}: {_shown(value)} is neither delta-seconds nor an HTTP-date "
            f"(like '120' or 'Wed, 21 Oct 2015 07:28:00 GMT')"
        ) from None
    if date.tzinfo is None:
        date = date.replace(tzinfo=UTC)
    return date.timestamp() - now


def _shown(value: str) -> str:
    """``value`` fit for a one-line message: quoted, and cut if long (a service's error page)."""
    return repr(value if len(value) <= 80 else value[:77] + "...")
