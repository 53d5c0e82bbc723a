"""Assertions about timing on this host's clock: the only failures a test may rerun.

The guarantee (starts at least one interval apart, in ticket order) is asserted on the
store's clock, exactly, with no rerun. What task bodies see on the host's clock also
depends on how this machine schedules processes (2 shared cores, rare latency spikes of
tens of milliseconds), so those assertions raise :class:`HostClockTiming`, and a test
marked :data:`HOST_CLOCK_RERUNS` is run again for that failure only: any other failure
fails at once. The session's summary counts the reruns (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest


class HostClockTiming(AssertionError):
    """A timing assertion on this host's clock failed."""


def host_clock(ok: bool, message: str) -> None:
    if not ok:
        raise HostClockTiming(message)


def host_gaps_at_least(gaps: Iterable[float], ms: float, what: str = "gap between starts") -> None:
    """The smallest of ``gaps`` (ms, measured by task bodies on the host clock) is ``ms`` or more."""
    smallest = min(gaps)
    host_clock(smallest >= ms, f"smallest {what}, host clock: {smallest:.2f} ms < {ms:.2f} ms")


#: Reruns for a host-clock timing failure only.
HOST_CLOCK_RERUNS = pytest.mark.flaky(reruns=2, only_rerun=[HostClockTiming])
