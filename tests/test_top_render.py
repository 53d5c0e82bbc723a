"""What ``siq top`` draws, rendered by rich at a given terminal width (no terminal needed):
the queue names whole in 80 columns, and "of limit" the use of the limit that binds."""

from __future__ import annotations

import time
import uuid

from rich.console import Console

from siq_celery.backends import backend_from_url
from siq_celery.client.queue import IntervalQueue
from siq_celery.observe.metrics import StoreCollector
from siq_celery.observe.top import QueueRates, RecentLateness, table


def render(url: str, width: int, rates: QueueRates | None = None) -> dict[str, list[str]]:
    """The table's rows by queue, as a terminal ``width`` columns wide shows them."""
    backend = backend_from_url(url)
    console = Console(width=width, record=True, color_system=None)
    console.print(table(StoreCollector(backend, ("*",)), rates or QueueRates(), "*", RecentLateness()))
    screen = console.export_text()
    print(f"\n{screen}")
    assert all(len(line) <= width for line in screen.splitlines()), screen
    rows = {}
    for line in screen.splitlines():
        if line.startswith(("│", "┃")):
            cells = [cell.strip() for cell in line.replace("┃", "│").rstrip()[1:-1].split("│")]
            if cells[0]:  # not a wrapped cell's next line
                rows[cells[0]] = cells
    return rows


def test_queue_names_stay_whole_in_80_columns() -> None:
    url = f"memory://top-{uuid.uuid4().hex}"
    backend = backend_from_url(url)
    names = ["shop:eu-west:orders", "geocoder", "{tenant-0042}search"]
    for name in names:
        IntervalQueue(name, interval="200ms", backend=backend).ensure()
    IntervalQueue("api:quota", interval="10ms", quota="40/20s", burst=2, concurrency=3, backend=backend).ensure()
    rows = render(url, 80)
    assert set(rows) == {"queue", *names, "api:quota"}, rows
    assert rows["geocoder"][-1] == "running"  # the state, the last column, is kept too


def test_of_limit_is_the_use_of_the_limit_that_binds() -> None:
    """A queue held by its quota at 40/40 in 20s runs at a fraction of its 100/s spacing:
    what binds is the quota, 100 % used; a cap with every body running is at 100 % too."""
    url = f"memory://top-{uuid.uuid4().hex}"
    backend = backend_from_url(url)
    quota = IntervalQueue("api:quota", interval="10ms", quota="40/20s", backend=backend)
    quota.ensure()
    cap = IntervalQueue("cap", interval=None, concurrency=2, backend=backend)
    cap.ensure()
    spaced = IntervalQueue("spaced", interval="100ms", backend=backend)
    spaced.ensure()
    rates = QueueRates()
    seen = time.monotonic()
    for name in ("api:quota", "cap", "spaced"):
        rates.rate(name, seen - 4.0, 0)  # an earlier reading, 4 s ago: 0 starts
    for _ in range(40):
        with quota.slot():
            pass
    assert [cap.wait_for_turn(task_id=f"c{n}").lease for n in range(2)]  # two bodies running: the cap full
    with spaced.slot():
        pass
    rows = render(url, 160, rates)
    of_limit = rows["queue"].index("of limit")
    assert rows["api:quota"][of_limit] == "100%", rows["api:quota"]  # 40/40: not 40 / 4 s of 100/s
    assert rows["cap"][of_limit] == "100%", rows["cap"]  # 2/2 in flight; no spacing of its own
    assert rows["spaced"][of_limit] in ("2%", "3%"), rows["spaced"]  # 1 start in about 4 s of 10/s
