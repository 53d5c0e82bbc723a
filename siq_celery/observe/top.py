"""``siq top``: a live terminal view of interval queues, refreshed every second.

It reads the store as the exporter does (:class:`siq_celery.observe.metrics.StoreCollector`):
for each queue the rate of the last few seconds (from the store's count of starts) and the
use of the limit that binds (the largest of the spacing's, the quota's and the cap's), what
binds beyond the interval as ``siq status`` shows it (a ``limits`` column: the quota's use of
its window, the burst, the bodies in flight against the cap; only when some queue has one),
the backlog and the time to drain it, the lateness of recent starts (the ledger's, from the
moment ``siq top`` first saw the queue: nothing older is read), and whether it is paused or
held; below, for each queue with tasks waiting in fair lines, how many keys and tasks wait
and the keys with the most waiting. In a narrow terminal the queue names stay whole and the
least needed columns are left out (:class:`QueueTable`). ``q`` or Ctrl-C quits. Drawn with
``rich``; read-only, like the exporter.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..backends import Backend
from ..errors import SiqError
from ..limits import NO_SPACING_US
from ..types import QueueStatus
from .metrics import Scrape, StoreCollector
from .readings import binding_use, drain_seconds, has_limits, held_until, limits_text

#: The rate is measured over about this many seconds of readings.
RATE_WINDOW_S = 5.0
#: The lateness shown is that of each queue's last this many starts.
RECENT_STARTS = 500
#: The fairness keys shown per fair queue: those with the most waiting.
FAIR_TOP = 5


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

    def keep_only(self, queues: Iterable[str]) -> None:
        """Forget the readings of every queue but ``queues`` (those no longer shown)."""
        for gone in set(self._seen) - set(queues):
            del self._seen[gone]


class RecentLateness:
    """The lateness (µs) of each queue's recent starts, read from its ledger incrementally
    from the store time the queue was first seen (each reading reads only what is new)."""

    def __init__(self, keep: int = RECENT_STARTS) -> None:
        self._keep = keep
        #: per queue: the last start read, and the (epoch, ticket) of the starts at that
        #: very microsecond (the next read begins there again)
        self._last: dict[str, tuple[int, set[tuple[str, int]]]] = {}
        self._late: dict[str, deque[int]] = {}

    def read(self, backend: Backend, statuses: Sequence[QueueStatus]) -> None:
        """Read the new starts of the queues of ``statuses``; forget every other queue."""
        since = {st.queue: self._last.get(st.queue, (st.now_us, set()))[0] for st in statuses}
        for gone in set(self._last) - set(since):
            del self._last[gone]
            self._late.pop(gone, None)
        rows = backend.starts_since(since)
        for queue, low in since.items():
            _, seen = self._last.get(queue, (low, set()))
            fresh = sorted((r for r in rows.get(queue, ()) if r.start_us > low or
                            (r.start_us == low and (r.epoch, r.ticket) not in seen)),
                           key=lambda r: (r.start_us, r.ticket))  # fmt: skip
            late = self._late.setdefault(queue, deque(maxlen=self._keep))
            late.extend(max(0, r.start_us - r.slot_us) for r in fresh)
            if fresh:
                last = fresh[-1].start_us
                at_last = {(r.epoch, r.ticket) for r in fresh if r.start_us == last}
                seen = seen | at_last if last == low else at_last
                low = last
            self._last[queue] = (low, seen)

    def of(self, queue: str) -> list[int]:
        """The lateness of ``queue``'s recent starts, sorted."""
        return sorted(self._late.get(queue, ()))


#: The columns of the table: name, justification.
COLUMNS = (
    ("queue", "left"), ("rate/s", "right"), ("limit/s", "right"), ("of limit", "right"), ("limits", "left"),
    ("backlog", "right"), ("drain", "right"), ("late p50", "right"), ("late max", "right"), ("parked", "right"),
    ("state", "left"),
)  # fmt: skip
#: In a terminal too narrow for every column, these go first, in this order (the queue
#: name, the rate, the use of what binds, the backlog and the state stay; the limits wrap).
DROPPED_FIRST = ("late max", "parked", "limit/s", "late p50", "drain")


class QueueTable:
    """The queues' table, drawn at the width of the terminal: each queue's name whole, and
    the columns that do not fit left out, the least needed first (:data:`DROPPED_FIRST`)."""

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.title, self.columns, self.rows = title, list(columns), [list(row) for row in rows]

    def shown(self, width: int) -> list[str]:
        """The columns that fit in ``width`` cells (the limits may wrap to fit)."""
        from rich.text import Text

        needed = {
            name: max(len(name), *(Text.from_markup(row[i]).cell_len for row in self.rows))
            for i, name in enumerate(self.columns)
        }
        if "limits" in needed:
            needed["limits"] = min(needed["limits"], 16)  # wraps
        shown = list(self.columns)
        for name in DROPPED_FIRST:
            if sum(needed[c] + 3 for c in shown) + 1 <= width:
                break
            shown.remove(name)
        return shown

    def grid(self, width: int) -> Any:
        from rich.table import Table

        shown = self.shown(width)
        justify = dict(COLUMNS)
        grid = Table(title=self.title, title_justify="left", expand=True)
        longest = max((len(row[0]) for row in self.rows), default=0)
        for name in shown:
            if name == "queue":  # never cut: at most half the width
                grid.add_column(name, no_wrap=True, min_width=min(longest, width // 2))
            else:
                grid.add_column(name, justify=justify[name], no_wrap=name != "limits")  # type: ignore[arg-type]
        for row in self.rows:
            grid.add_row(*(cell for name, cell in zip(self.columns, row, strict=True) if name in shown))
        return grid

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        yield self.grid(options.max_width)


def table(collector: StoreCollector, rates: QueueRates, pattern: str, recent: RecentLateness | None = None) -> Any:
    scrape = collector.scrape()
    now = time.monotonic()
    title = f"siq top  {pattern}  {time.strftime('%H:%M:%S')}  "
    title += f"{len(scrape.statuses)} queue(s)" if scrape.up else "[bold red]state store unreachable[/]"
    if scrape.left_out:
        title += f" ({scrape.left_out} more not shown)"
    limited = any(has_limits(st) for st in scrape.statuses)  # a limits column only then, as siq status
    columns = [name for name, _ in COLUMNS if limited or name != "limits"]
    recent = recent or RecentLateness()
    if scrape.up:
        rates.keep_only(st.queue for st in scrape.statuses)
        with contextlib.suppress(SiqError):  # the lateness is left as it was; the rest is shown
            recent.read(collector.backend, scrape.statuses)
    rows = []
    for st in scrape.statuses:
        # a queue with a quota or a cap alone has no spacing of its own: no rate limit to show
        limit = 1e6 / st.state.interval_us if st.state.interval_us > NO_SPACING_US else None
        rate = rates.rate(st.queue, now, st.counts.starts)
        use = binding_use(st, rate)  # of the limit that binds: spacing, quota or cap
        late = recent.of(st.queue)
        state = "paused" if st.state.paused else ("held" if held_until(st) else "running")
        rows.append([
            st.queue,
            "-" if rate is None else f"{rate:.2f}",
            "-" if limit is None else f"{limit:.2f}",
            "-" if use is None else f"{100 * use:.0f}%",
            *([limits_text(st)] if limited else []),
            str(st.state.backlog),
            f"{drain_seconds(st):.1f}s",
            f"{late[len(late) // 2] / 1000:.1f}ms" if late else "-",
            f"{late[-1] / 1000:.1f}ms" if late else "-",
            str(st.parked),
            f"[yellow]{state}[/]" if state != "running" else state,
        ])  # fmt: skip
    grid = QueueTable(title, columns, rows)
    fair = fair_table(scrape)
    if fair is None:
        return grid
    from rich.console import Group

    return Group(grid, fair)


def fair_table(scrape: Scrape) -> Any:
    """Who waits in the fair lines of the queues that have tasks waiting there (None: no
    such queue): the keys and tasks waiting, and the keys with the most waiting."""
    from rich.markup import escape
    from rich.table import Table

    fair = [(st.queue, scrape.fair_of(st)) for st in scrape.statuses if st.fair_tasks]
    if not fair:
        return None
    grid = Table(title="fair shares", title_justify="left", expand=True)
    for name, justify in (("queue", "left"), ("keys", "right"), ("tasks", "right"), ("most waiting", "left")):
        grid.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    for queue, backlog in fair:
        most = ", ".join(f"{escape(key)} {n:,} (w{weight})" for key, n, weight in backlog.top)
        more = backlog.keys_waiting - len(backlog.top)
        grid.add_row(queue, f"{backlog.keys_waiting:,}", f"{backlog.tasks_waiting:,}",
                     most + (f", +{more:,} more" if more > 0 and most else "") or "-")  # fmt: skip
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

    collector = StoreCollector(backend, (pattern,), max_queues, fair_top=FAIR_TOP)
    rates, recent = QueueRates(), RecentLateness()
    with (
        keys_without_echo() as fd,
        Live(table(collector, rates, pattern, recent), auto_refresh=False, screen=True) as live,
    ):
        try:
            while True:
                deadline = time.monotonic() + refresh
                while (left := deadline - time.monotonic()) > 0:
                    if fd is None:
                        time.sleep(left)
                    elif select.select([fd], [], [], left)[0] and os.read(fd, 1) in (b"q", b"Q"):
                        return
                live.update(table(collector, rates, pattern, recent), refresh=True)
        except KeyboardInterrupt:
            return
