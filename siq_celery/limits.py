"""The limit kinds beyond spacing, as users write them: ``burst=``, ``quota=``, ``concurrency=``, ``margin=``.

* ``burst=B`` (a whole number, 0 to 10 000; default 0): up to B starts may come closer than
  the interval to catch up after lateness or idleness. In any half-open window of length W
  at most ceil(W / interval) + B starts (store clock). 0 is strict spacing.
* ``quota="N/period"`` (``"10000/d"``, ``"50/10s"``, or a pair ``(N, period)``): at most N
  cost units start in any sliding window of that period, on the store's clock, as fast as
  the other limits allow. (For ``interval=`` the same text keeps meaning spacing, one start
  per period / N, as Celery's ``rate_limit`` does.)
* ``concurrency=N`` (a whole number, 1 to 100 000; default None: no cap): at most N bodies of
  the queue running at once across every node. A start takes a lease, the end of its body
  gives it back; a lease of a process that died expires after ``siq_lease_timeout``.
* ``margin="5ms"`` (a duration, 0 to 60 s; default 0): added to the spacing and to the
  quota's window, for what lies between a body's start and the provider's count of it
  (connection set-up, the network, a process preempted after its report).

:class:`Limit` bundles an interval with them, for one queue of several limits
(``interval_queue={"{geo}api": Limit(interval="100ms", quota="10000/d")}``). A limit with a
quota (or a concurrency cap) and no interval has no spacing of its own: only the window
(or the cap) binds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeAlias

from .errors import ConfigurationError, InvalidIntervalError
from .intervals import _NUMBER, _UNIT, _UNITS_US, IntervalLike, format_interval, parse_duration, parse_interval
from .types import NO_LIMITS, Limits, LimitsOverride

QuotaLike: TypeAlias = str | tuple[int, IntervalLike]

#: The interval stored for a queue without spacing of its own (a quota alone): 1 µs.
NO_SPACING_US = 1
MAX_BURST = 10_000
MAX_QUOTA = 10_000_000
MAX_CONCURRENCY = 100_000
MAX_MARGIN_US = 60_000_000  # 60 s
MIN_WINDOW_US = 1_000  # 1 ms
MAX_WINDOW_US = 31 * 86_400_000_000  # 31 days
#: In a mapping of several limits, an interval written as a rate whose period is longer than
#: this is refused: it reads as a quota ("10000/d") but would space starts (8.64 s apart).
RATE_READS_AS_QUOTA_US = 3_600_000_000

_RATE = re.compile(rf"^\s*([0-9]+)\s*/\s*{_NUMBER}?\s*{_UNIT}\s*$")
_ANY_RATE = re.compile(rf"^\s*{_NUMBER}\s*/\s*{_NUMBER}?\s*{_UNIT}\s*$")


def parse_quota(value: QuotaLike) -> tuple[int, int]:
    """``"N/period"`` or ``(N, period)`` as (N cost units, window in microseconds)."""
    if isinstance(value, tuple) and len(value) == 2:
        count, period = value
        window_us = parse_duration(period)
    elif isinstance(value, str) and (m := _RATE.match(value)):
        count = int(m.group(1))
        window_us = round(float(m.group(2) or 1) * _UNITS_US[m.group(3)])
    else:
        raise ConfigurationError(
            f"quota {value!r}: write it as 'N/period', like '10000/d', '50/10s' or '600/h' (N a whole number)"
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_QUOTA:
        raise ConfigurationError(f"quota {value!r}: N is a whole number from 1 to {MAX_QUOTA}")
    if not MIN_WINDOW_US <= window_us <= MAX_WINDOW_US:
        raise ConfigurationError(f"quota {value!r}: the period is from 1 ms to 31 days")
    return count, window_us


def validate_burst(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BURST:
        raise ConfigurationError(f"burst {value!r}: a whole number of starts from 0 to {MAX_BURST}")
    return value


def validate_concurrency(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ConfigurationError(
            f"concurrency {value!r}: a whole number of bodies running at once, from 1 to {MAX_CONCURRENCY}"
        )
    return value


def validate_margin(value: object) -> int:
    """A margin (a duration: ``"5ms"``, seconds, a timedelta) in microseconds, 0 to 60 s."""
    try:
        margin_us = parse_duration(value)  # type: ignore[arg-type]
    except InvalidIntervalError:
        margin_us = -1
    if isinstance(value, bool) or not 0 <= margin_us <= MAX_MARGIN_US:
        raise ConfigurationError(f"margin {value!r}: a duration from 0 to 60 s, like '5ms' or 0.005")
    return margin_us


def limits_of(
    burst: int | None, quota: QuotaLike | None, concurrency: int | None = None, margin: IntervalLike | None = None
) -> Limits:
    """The store's :class:`Limits` for ``burst=``, ``quota=``, ``concurrency=`` and
    ``margin=`` (None: none)."""
    if burst is None and quota is None and concurrency is None and margin is None:
        return NO_LIMITS
    count, window_us = parse_quota(quota) if quota is not None else (0, 0)
    cap = validate_concurrency(concurrency) if concurrency is not None else 0
    margin_us = validate_margin(margin) if margin is not None else 0
    return Limits(validate_burst(burst or 0), count, window_us, cap, margin_us)


#: What lifts a kind in an override (``siq set-limits q --quota none``).
NONE = "none"


def limits_override(
    burst: int | str | None = None,
    quota: QuotaLike | None = None,
    concurrency: int | str | None = None,
    margin: IntervalLike | None = None,
) -> LimitsOverride:
    """An operator's override of some kinds (None: that kind is not overridden): ``burst``
    0 to 10 000; ``quota`` ``"N/period"``, or ``"none"`` for no quota; ``concurrency`` 1 to
    100 000, or ``"none"`` for no cap; ``margin`` a duration (``"5ms"``; 0 or ``"none"``: no
    margin). Text from a command line is read as numbers."""
    b = validate_burst(_whole(burst, "burst")) if burst is not None else None
    if quota is None:
        n, window = None, 0
    elif isinstance(quota, str) and quota.strip().lower() == NONE:
        n, window = 0, 0
    else:
        n, window = parse_quota(quota)
    if concurrency is None:
        c = None
    elif isinstance(concurrency, str) and concurrency.strip().lower() == NONE:
        c = 0
    else:
        c = validate_concurrency(_whole(concurrency, "concurrency"))
    if margin is None:
        m = None
    elif isinstance(margin, str) and margin.strip().lower() == NONE:
        m = 0
    else:
        m = validate_margin(margin)
    return LimitsOverride(b, n, window, c, m)


def _whole(value: object, kind: str) -> object:
    """Text of a whole number as the number (anything else as it is, for its own error)."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            hint = " or 'none'" if kind != "burst" else ""
            raise ConfigurationError(f"{kind} {value!r}: a whole number{hint}") from None
    return value


def format_limits(limits: Limits) -> str:
    """The limits beyond the interval for people: ``burst 2, quota 100/1m, concurrency 5``
    (``none``: none of them)."""
    parts = []
    if limits.burst:
        parts.append(f"burst {limits.burst}")
    if limits.quota:
        parts.append(f"quota {limits.quota}/{format_interval(limits.window_us)}")
    if limits.concurrency:
        parts.append(f"concurrency {limits.concurrency}")
    if limits.margin_us:
        parts.append(f"margin {format_interval(limits.margin_us)}")
    return ", ".join(parts) or "none"


def format_override(override: LimitsOverride) -> str:
    """The kinds an override sets, for people: ``quota none, concurrency 5``."""
    parts = []
    if override.burst is not None:
        parts.append(f"burst {override.burst}")
    if override.quota is not None:
        quota = f"{override.quota}/{format_interval(override.window_us)}" if override.quota else NONE
        parts.append(f"quota {quota}")
    if override.concurrency is not None:
        parts.append(f"concurrency {override.concurrency or NONE}")
    if override.margin_us is not None:
        parts.append(f"margin {format_interval(override.margin_us) if override.margin_us else NONE}")
    return ", ".join(parts)


def check_not_a_quota(value: object, where: str) -> None:
    """Refuse an interval that reads as a quota among several limits: ``"10000/d"`` spaces
    starts 8.64 s apart, where a provider's "10,000 a day" means at most 10,000 in any day."""
    if isinstance(value, str) and (m := _ANY_RATE.match(value)):
        count, period = float(m.group(1)), float(m.group(2) or 1) * _UNITS_US[m.group(3)]
        if count > 1 and period > RATE_READS_AS_QUOTA_US:
            raise ConfigurationError(
                f"{where}: interval {value!r} would space starts {period / count / 1e6:g} s apart, one at a time. "
                f"For at most {m.group(1)} in any {value.split('/', 1)[1].strip()}, write "
                f"Limit(quota={value!r}) (or quota={value!r} with the queue's interval); for spacing, write the "
                f"interval as a duration"
            )


@dataclass(frozen=True)
class Limit:
    """One queue's limits: an ``interval`` (spacing: seconds, ``"100ms"``, a rate
    ``"10/s"``; None with a quota or a concurrency cap: no spacing), a ``burst``, a window
    ``quota`` (``"10000/d"``), a ``concurrency`` cap and a ``margin`` (added to the spacing
    and the window). A value of ``interval_queue={name: ...}``, or of IntervalQueue's
    ``interval=``."""

    interval: IntervalLike | None = None
    burst: int | None = None
    quota: QuotaLike | None = None
    concurrency: int | None = None
    margin: IntervalLike | None = None

    def __post_init__(self) -> None:
        if self.interval is None and self.quota is None and self.concurrency is None:
            raise ConfigurationError("Limit() needs an interval, a quota or a concurrency cap")
        self.resolve()  # refuses what cannot be parsed, where it is written

    def resolve(self, default_interval_us: int | None = None) -> tuple[int | None, Limits]:
        """(interval in microseconds, or ``default_interval_us`` if none, or no spacing
        with a quota or a concurrency cap; the store's Limits)."""
        limits = limits_of(self.burst, self.quota, self.concurrency, self.margin)
        if self.interval is not None:
            try:
                return parse_interval(self.interval), limits
            except InvalidIntervalError as exc:
                raise ConfigurationError(f"{self!r}: {exc}") from None
        return (NO_SPACING_US if limits.quota or limits.concurrency else default_interval_us), limits


def interval_and_limits(
    interval: IntervalLike | Limit | None,
    burst: int | None,
    quota: QuotaLike | None,
    concurrency: int | None = None,
    margin: IntervalLike | None = None,
) -> tuple[int | None, Limits]:
    """An IntervalQueue's interval (None: the stored one) and limits, from its options. A
    quota or a concurrency cap without an interval means no spacing."""
    if isinstance(interval, Limit):
        if burst is not None or quota is not None or concurrency is not None or margin is not None:
            raise ConfigurationError("give burst=, quota=, concurrency= and margin= inside the Limit, or without one")
        return interval.resolve()
    limits = limits_of(burst, quota, concurrency, margin)
    if isinstance(interval, timedelta | int | float | str):
        return parse_interval(interval), limits
    return (NO_SPACING_US if limits.quota or limits.concurrency else None), limits
