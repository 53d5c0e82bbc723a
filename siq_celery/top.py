"""``siq top``: a live terminal view of interval queues, refreshed every second.

It reads the store as the exporter does (:class:`siq_celery.metrics.StoreCollector`):
for each queue the rate of the last few seconds against its limit, the backlog and the
time to drain it, the lateness of recent starts, and whether it is paused or held. ``q``
or Ctrl-C quits. Drawn with ``rich``; read-only, like the exporter.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from .backends import Backend
from .metrics import StoreCollector, drain_seconds, held_until

#: The rate is measured over about this many seconds of readings.
RATE_WINDOW_S = 5.0


class QueueRates:
    """Starts counted at each reading, to give a rate over the last few seconds."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[tuple[float, int]]] = {}

    def rate(self, queue: str, at: float, starts: int) -> float | None:
        seen = self._seen.setdefault(queue, deque())
        seen.append((at, starts))
        while len(seen) > 2 and at - seen[1][0] >= RATE_WINDOW_S:
            seen.popleft()
        (t0, n0) = seen[0]
        return (starts - n0) / (at - t0) if at > t0 else None


def table(collector: StoreCollector, rates: QueueRates, pattern: str) -> Any:
    from rich.table import Table

    scrape = collector.scrape()
    now = time.monotonic()
    title = f"siq top  {pattern}  {time.strftime('%H:%M:%S')}  "
    title += f"{len(scrape.statuses)} queue(s)" if scrape.up else "[bold red]state store unreachable[/]"
    if scrape.left_out:
        title += f" ({scrape.left_out} more not shown)"
    grid = Table(title=title, title_justify="left", expand=True)
    for name, justify in (("queue", "left"), ("rate/s", "right"), ("limit/s", "right"), ("of limit", "right"),
                          ("backlog", "right"), ("drain", "right"), ("late p50", "right"), ("late max", "right"),
                          ("parked", "right"), ("state", "left")):  # fmt: skip
        grid.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for st in scrape.statuses:
        tally = collector.tally(st.queue)
        limit = 1e6 / st.state.interval_us
        rate = rates.rate(st.queue, now, tally.starts) if tally else None
        recent = sorted(tally.recent_lateness_us or ()) if tally else []
        state = "paused" if st.state.paused else ("held" if held_until(st) else "running")
        grid.add_row(
            st.queue,
            "-" if rate is None else f"{rate:.2f}",
            f"{limit:.2f}",
            "-" if rate is None else f"{100 * rate / limit:.0f}%",
            str(st.state.backlog),
            f"{drain_seconds(st):.1f}s",
            f"{recent[len(recent) // 2] / 1000:.1f}ms" if recent else "-",
            f"{recent[-1] / 1000:.1f}ms" if recent else "-",
            str(st.parked),
            f"[yellow]{state}[/]" if state != "running" else state,
        )
    return grid


@contextlib.contextmanager
def keys_without_echo() -> Iterator[Any]:
    """Single key presses from stdin, when it is a terminal (else nothing is read)."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(backend: Backend, pattern: str = "*", refresh: float = 1.0, max_queues: int = 200) -> None:
    """Show the queues matching ``pattern`` until ``q`` or Ctrl-C."""
    from rich.live import Live

    collector = StoreCollector(backend, (pattern,), max_queues, keep_recent=True)
    rates = QueueRates()
    with keys_without_echo() as fd, Live(table(collector, rates, pattern), auto_refresh=False, screen=True) as live:
        try:
            while True:
                deadline = time.monotonic() + refresh
                while (left := deadline - time.monotonic()) > 0:
                    if fd is None:
                        time.sleep(left)
                    elif select.select([fd], [], [], left)[0] and os.read(fd, 1) in (b"q", b"Q"):
                        return
                live.update(table(collector, rates, pattern), refresh=True)
        except KeyboardInterrupt:
            return
