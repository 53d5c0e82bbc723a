"""The exporter's readings without a server: the ledger tally (incremental, each start
counted once however the reads overlap), the derived gauges, and the README's table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from siq_celery.backends import backend_from_url
from siq_celery.ledger import LedgerRow
from siq_celery.metrics import LATENESS_BUCKETS, LedgerTally, StoreCollector, drain_seconds, held_until, text
from siq_celery.types import IntervalSources, QueueState, QueueStatus

ROOT = Path(__file__).resolve().parent.parent
I = 100_000


def row(ticket: int, start_us: int, slot_us: int | None = None, epoch: str = "e1", deferrals: int = 0) -> LedgerRow:
    return LedgerRow("q", epoch, ticket, f"t{ticket}", "call", start_us if slot_us is None else slot_us, start_us, I,
                     deferrals=deferrals)  # fmt: skip


def test_overlapping_reads_count_each_start_once() -> None:
    tally = LedgerTally()
    rows = [row(1, 1_000_000), row(2, 1_100_000, 1_099_000), row(3, 1_100_000, 1_100_000), row(4, 1_250_000)]
    tally.add(rows[:3])
    assert tally.starts == 3 and tally.last_start_us == 1_100_000
    tally.add(rows[1:])  # the next read starts again at the last start's time, in any order
    tally.add(rows[3:][::-1] + rows[2:3])
    assert tally.starts == 4
    assert tally.gaps_below_interval == 1  # ticket 3 started with ticket 2: a gap of 0
    assert tally.lateness_sum == 0.001
    assert sum(tally.lateness_buckets) == 4 and tally.lateness_buckets[LATENESS_BUCKETS.index(0.001)] == 1


def test_deferrals_add_up_and_late_starts_land_in_their_bucket() -> None:
    tally = LedgerTally()
    tally.add([row(1, 10_000_000, 9_990_000, deferrals=2), row(2, 30_000_000, 10_000_000, deferrals=1)])
    assert tally.deferrals == 3 and tally.gaps_below_interval == 0
    assert tally.lateness_buckets[LATENESS_BUCKETS.index(0.01)] == 1
    assert tally.lateness_buckets[-1] == 1  # 20 s late: past the last bucket


def status(now: int, *, last: int, anchor: int, ticket: int = 0, current: int = 0, paused: bool = False) -> QueueStatus:
    return QueueStatus("q", QueueState("e1", I, ticket, current, anchor, last, paused), now, 0, 0, IntervalSources())


def test_a_hold_is_a_next_slot_further_than_one_interval() -> None:
    running = status(10 * I, last=10 * I - 10, anchor=9 * I)
    assert held_until(running) == 0
    backed_off = status(10 * I, last=10 * I + 30 * I, anchor=9 * I)  # a back-off moves the last start ahead
    assert held_until(backed_off) == 41 * I
    assert held_until(status(10 * I, last=40 * I, anchor=0, paused=True)) == 0


def test_drain_time_is_the_wait_for_the_first_and_an_interval_for_each_other() -> None:
    assert drain_seconds(status(10 * I, last=10 * I, anchor=0, ticket=5, current=5)) == 0
    st = status(10 * I, last=10 * I, anchor=0, ticket=15, current=5)  # next slot in one interval
    assert drain_seconds(st) == (I + 9 * I) / 1e6


def test_the_readme_lists_every_metric_served() -> None:
    backend = backend_from_url("memory://readme-metrics")
    backend.ensure("api", I, "e1")
    served = {line.split()[2] for line in text(StoreCollector(backend)).splitlines() if line.startswith("# TYPE")}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| `siq_up`") : readme.index("Every per-queue series")]
    listed = set(re.findall(r"`(siq_\w+)", table))
    assert listed == served


def test_a_queue_that_expires_drops_out_and_once_prints_one_scrape() -> None:
    from click.testing import CliRunner

    from siq_celery.cli import siq

    backend = backend_from_url("memory://expiring-metrics")
    for name in ("shop:1", "shop:2", "api"):
        backend.ensure(name, I, "e1")
    collector = StoreCollector(backend, ("shop:*",))
    assert [st.queue for st in collector.scrape().statuses] == ["shop:1", "shop:2"]
    backend.delete("shop:1")  # as an idle per-key queue's state expires
    assert [st.queue for st in collector.scrape().statuses] == ["shop:2"]
    assert collector.tally("shop:1") is None and 'queue="shop:1"' not in text(collector)

    result = CliRunner().invoke(siq, ["--url", "memory://expiring-metrics", "exporter", "--once", "api"])
    assert result.exit_code == 0, result.output
    assert 'siq_queue_interval_seconds{queue="api"} 0.1' in result.output and "shop:2" not in result.output
    bad = CliRunner().invoke(siq, ["--url", "memory://expiring-metrics", "exporter", "--max-queues", "0"])
    assert bad.exit_code == 2 and "--max-queues" in bad.output


@pytest.mark.parametrize(("command", "module"), [("exporter", "prometheus_client"), ("top", "rich")])
def test_a_missing_metrics_extra_is_one_line_that_says_what_to_install(command: str, module: str) -> None:
    hide = f"import sys; sys.modules[{module!r}] = None; from siq_celery.cli import main; main()"
    args = ["--url", "memory://no-extra", command, *(["--once"] if command == "exporter" else [])]
    result = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    print(result.stderr)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"Error: siq {command} needs {module}")
    assert "pip install 'siq_celery[metrics]'" in result.stderr
