"""The exporter's readings without a server: the counters the store keeps (the same for
every exporter, a restart and a trimmed ledger), the derived gauges, and the table of
docs/monitoring.md."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import urllib.request
from pathlib import Path
from typing import NoReturn

import pytest
from prometheus_client.parser import text_string_to_metric_families

from siq_celery.backends import backend_from_url
from siq_celery.ledger import LedgerRow, StartRecord
from siq_celery.observe.metrics import LATENESS_BUCKETS, StoreCollector
from siq_celery.observe.metrics_http import text
from siq_celery.observe.readings import drain_seconds, held_until
from siq_celery.observe.top import RecentLateness
from siq_celery.rules import start_counts
from siq_celery.testing import PinnedClock
from siq_celery.types import IntervalSources, QueueState, QueueStatus

ROOT = Path(__file__).resolve().parent.parent
I = 100_000


def row(ticket: int, start_us: int, slot_us: int | None = None, epoch: str = "e1", deferrals: int = 0) -> LedgerRow:
    return LedgerRow("q", epoch, ticket, f"t{ticket}", "call", start_us if slot_us is None else slot_us, start_us, I,
                     deferrals=deferrals)  # fmt: skip


def test_top_reads_each_recent_start_once_however_the_reads_overlap() -> None:
    rows = [row(1, 1_000_000), row(2, 1_100_000, 1_099_000), row(3, 1_100_000, 1_100_000), row(4, 1_250_000)]
    reads = iter([rows[:3], rows[1:], rows[3:][::-1] + rows[2:3]])

    class Ledger:
        def starts_since(self, since: dict[str, int]) -> dict[str, list[LedgerRow]]:
            if not since:
                return {}
            assert since["q"] in (900_000, 1_100_000, 1_250_000)  # from when top first saw it, then the last start
            return {"q": [r for r in next(reads) if r.start_us >= since["q"]]}

    recent = RecentLateness()
    seen = status(900_000, last=0, anchor=0)
    for _ in range(3):
        recent.read(Ledger(), [seen])  # type: ignore[arg-type]
    assert recent.of("q") == [0, 0, 0, 1000]
    recent.read(Ledger(), [])  # type: ignore[arg-type]
    assert recent.of("q") == []  # a queue no longer shown is forgotten


def test_a_start_adds_one_to_its_lateness_bucket_and_a_gap_only_below_the_interval() -> None:
    assert start_counts(None, 10 * I, 10 * I, I) == {"starts": 1, "late_us": 0, "late:0": 1}
    late = start_counts(9 * I, 10 * I + 3_000, 10 * I, I, deferrals=2)
    assert late == {"starts": 1, "late_us": 3_000, f"late:{LATENESS_BUCKETS.index(0.005)}": 1, "deferrals": 2}
    assert start_counts(10 * I, 10 * I + 20_000_000, 10 * I, I)[f"late:{len(LATENESS_BUCKETS)}"] == 1  # past the last
    assert start_counts(10 * I - I + 1000, 10 * I, 10 * I, I).get("gaps") is None  # 1 ms short: tolerated
    assert start_counts(10 * I - I + 1001, 10 * I, 10 * I, I)["gaps"] == 1


def test_every_exporter_reads_the_same_counters_and_a_trimmed_ledger_lowers_nothing() -> None:
    """Counters the store keeps: a second exporter, or one restarted, reads what the first
    reads, none of them reads a ledger, and the ledger's cap (here 2 starts) lowers nothing."""
    clock = PinnedClock()
    backend = backend_from_url("memory://counted-by-the-store", clock=clock, ledger_max=2)
    first = StoreCollector(backend)
    backend.ensure("api", I, "e1")
    claim = backend.claim("api", 5, I, "e1")
    for n in range(5):
        clock.advance(us=I)
        backend.start("api", claim.first + n, "e1", task_id=f"t{n}", interval_us=I, new_epoch="e1",
                      record=StartRecord("call", deferrals=1))  # fmt: skip
        first.scrape()
    assert len(list(backend.ledger("api"))) == 2

    def no_ledger(*_: object, **__: object) -> NoReturn:
        raise AssertionError("the exporter read a ledger")

    backend.ledger = backend.starts_since = no_ledger  # type: ignore[method-assign,assignment]
    restarted = StoreCollector(backend)
    for collector in (first, restarted):
        samples = {s.name: s.value for family in text_string_to_metric_families(text(collector))
                   for s in family.samples if s.labels == {"queue": "api"}}  # fmt: skip
        print({name: value for name, value in samples.items() if "total" in name or "count" in name})
        assert samples["siq_starts_total"] == 5 and samples["siq_deferrals_total"] == 5
        assert samples["siq_start_lateness_seconds_count"] == 5


def status(
    now: int, *, last: int, anchor: int, ticket: int = 0, current: int = 0, paused: bool = False, held: int = 0
) -> QueueStatus:
    state = QueueState("e1", I, ticket, current, anchor, last, paused, held_until_us=held)
    return QueueStatus("q", state, now, 0, 0, IntervalSources())


def test_a_hold_is_a_back_off_not_a_weighted_starts_slots() -> None:
    running = status(10 * I, last=10 * I - 10, anchor=9 * I)
    assert held_until(running) == 0
    backed_off = status(10 * I, last=10 * I + 30 * I, anchor=9 * I, held=41 * I)  # a back-off moves the last start
    assert held_until(backed_off) == 41 * I
    weighted = status(10 * I, last=10 * I + 9 * I, anchor=19 * I)  # a start of cost 10 just now
    assert held_until(weighted) == 0
    assert held_until(status(10 * I, last=40 * I, anchor=0, paused=True, held=41 * I)) == 0
    assert held_until(status(42 * I, last=40 * I, anchor=0, held=41 * I)) == 0  # over


def test_drain_time_is_the_wait_for_the_first_and_an_interval_for_each_other() -> None:
    assert drain_seconds(status(10 * I, last=10 * I, anchor=0, ticket=5, current=5)) == 0
    st = status(10 * I, last=10 * I, anchor=0, ticket=15, current=5)  # next slot in one interval
    assert drain_seconds(st) == (I + 9 * I) / 1e6


def test_the_monitoring_page_lists_every_metric_served() -> None:
    backend = backend_from_url("memory://documented-metrics")
    backend.ensure("api", I, "e1")
    served = {line.split()[2] for line in text(StoreCollector(backend)).splitlines() if line.startswith("# TYPE")}
    page = (ROOT / "docs" / "monitoring.md").read_text()
    table = page[page.index("| `siq_up`") : page.index("Every per-queue series")]
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
    assert 'queue="shop:1"' not in text(collector)

    result = CliRunner().invoke(siq, ["--url", "memory://expiring-metrics", "exporter", "--once", "api"])
    assert result.exit_code == 0, result.output
    assert 'siq_queue_interval_seconds{queue="api"} 0.1' in result.output and "shop:2" not in result.output
    bad = CliRunner().invoke(siq, ["--url", "memory://expiring-metrics", "exporter", "--max-queues", "0"])
    assert bad.exit_code == 2 and "--max-queues" in bad.output


def test_a_weighted_start_is_not_a_hold_and_a_back_off_is() -> None:
    from siq_celery import IntervalQueue
    from siq_celery.backends.memory import MemoryBackend

    now = [1_700_000_000_000_000]
    q = IntervalQueue("search", interval="100ms", backend=MemoryBackend(clock=lambda: now[0]))
    q.ensure()
    now[0] += I
    assert q.start(q.claim_costs([10])[0], cost=10).authorized  # the next start waits 10 intervals
    assert held_until(q.status()) == 0
    q.backoff(30)
    assert held_until(q.status()) == now[0] + 30_000_000


@pytest.mark.parametrize(("command", "module"), [("exporter", "prometheus_client"), ("top", "rich")])
def test_a_missing_metrics_extra_is_one_line_that_says_what_to_install(command: str, module: str) -> None:
    hide = f"import sys; sys.modules[{module!r}] = None; from siq_celery.cli import main; main()"
    args = ["--url", "memory://no-extra", command, *(["--once"] if command == "exporter" else [])]
    result = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    print(result.stderr)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"Error: siq {command} needs {module}")
    assert "pip install 'siq_celery[metrics]'" in result.stderr


def test_a_worker_of_per_key_tasks_exports_only_its_own_queues() -> None:
    """``siq_metrics_port`` on an app whose interval tasks are all per key: its queues have
    no fixed names, so without ``siq_metrics_queues`` it exports none, never every queue of
    the store (another app's, here ``billing``); with it, the keys it names."""
    from celery import Celery

    from siq_celery import IntervalTask
    from siq_celery.embedded import free_port
    from siq_celery.tasks.worker_metrics import WorkerMetrics

    backend = backend_from_url("memory://per-key-metrics")
    for name in ("billing", "shop:1"):
        backend.ensure(name, I, "e1")
    served: dict[str, str] = {}
    for patterns in (None, ["shop:*"]):
        app = Celery("per-key-metrics", set_as_current=False)
        app.conf.update(siq_url="memory://per-key-metrics", siq_metrics_port=free_port(), siq_metrics_queues=patterns)

        @app.task(base=IntervalTask, interval="100ms", shared=False,
                  interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}")  # fmt: skip
        def call(shop: str) -> None: ...

        metrics = WorkerMetrics()
        metrics.serve(sender=types.SimpleNamespace(app=app))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{app.conf.siq_metrics_port}/metrics", timeout=10) as r:
                served[str(patterns)] = r.read().decode()
        finally:
            metrics.stop()
    exported = {k: sorted(set(re.findall(r'queue="([^"]+)"', body))) for k, body in served.items()}
    print(exported)
    assert exported == {"None": [], "['shop:*']": ["shop:1"]}


def test_queues_no_longer_seen_are_forgotten_by_the_exporter_and_top(tmp_path: Path) -> None:
    """A long-running exporter or ``siq top`` over per-key queues that come and go keeps
    what it remembers per queue (errors counted, readings for the rate) for the queues
    it still sees, not for every queue it ever saw."""
    import sqlite3

    from siq_celery.observe.top import QueueRates, table

    backend = backend_from_url(f"sqlite:///{tmp_path}/siq.db")
    for n in range(50):
        backend.ensure(f"shop:{n}", I, "e1")
    with sqlite3.connect(tmp_path / "siq.db") as db:  # corrupt states, each counted as an error
        db.execute("UPDATE siq_queues SET interval_us='fast' WHERE queue IN ('shop:1', 'shop:2')")
    collector, rates = StoreCollector(backend, ("shop:*",)), QueueRates()
    table(collector, rates, "shop:*")
    assert 'siq_queue_errors_total{queue="shop:1"} 2.0' in text(collector)
    assert len(rates._seen) == 48
    with sqlite3.connect(tmp_path / "siq.db") as db:  # gone, all but one (as idle per-key queues expire)
        db.execute("DELETE FROM siq_queues WHERE queue != 'shop:0'")
    table(collector, rates, "shop:*")
    print(f"remembered: errors {sorted(collector._errors)}, rates {sorted(rates._seen)}")
    assert collector._errors == {} and set(rates._seen) == {"shop:0"}
    assert "shop:1" not in text(collector)


def test_the_exporter_shows_a_quotas_use_of_its_window_and_the_burst() -> None:
    from siq_celery import IntervalQueue

    clock = PinnedClock()
    backend = backend_from_url("memory://quota-metrics", clock=clock)
    q = IntervalQueue("api", interval="100ms", quota="5/1s", burst=2, backend=backend)
    q.ensure()
    IntervalQueue("plain", interval="100ms", backend=backend).ensure()
    for _ in range(3):
        clock.advance(us=I)
        assert q.start(q.claim()).authorized
    samples = {(s.name, s.labels["queue"]): s.value for family in text_string_to_metric_families(
        text(StoreCollector(backend))) for s in family.samples if "queue" in s.labels}  # fmt: skip
    print({k: v for k, v in samples.items() if "quota" in k[0] or "burst" in k[0]})
    assert samples[("siq_queue_quota_used_units", "api")] == 3 and samples[("siq_queue_quota_units", "api")] == 5
    assert samples[("siq_queue_quota_window_seconds", "api")] == 1.0 and samples[("siq_queue_burst", "api")] == 2
    assert ("siq_queue_quota_units", "plain") not in samples and ("siq_queue_burst", "plain") not in samples


def test_a_redis_database_the_server_lacks_is_siq_up_0_not_a_traceback(redis_url: str) -> None:
    backend = backend_from_url(redis_url.rsplit("/", 1)[0] + "/999")
    collector = StoreCollector(backend, ("shop", "other"))  # fixed names: read, not listed
    scrape = collector.scrape()
    assert not scrape.up
    assert "siq_up 0.0" in text(collector)


def test_top_shows_the_limits_beyond_the_interval_as_siq_status_does() -> None:
    """A ``limits`` column (the quota's use of its window, the burst, the bodies in flight
    against the cap), only when some queue has one; a queue without spacing of its own has
    no rate limit to show."""
    import io

    from rich.console import Console

    from siq_celery import IntervalQueue
    from siq_celery.cli import status_rows
    from siq_celery.observe.top import QueueRates, table

    def shown(backend: object) -> list[list[str]]:
        console = Console(file=io.StringIO(), width=200, color_system=None)
        console.print(table(StoreCollector(backend), QueueRates(), "*"))  # type: ignore[arg-type]
        text = console.file.getvalue()  # type: ignore[attr-defined]
        return [[c.strip() for c in line.strip("│┃ ").split("│" if "│" in line else "┃")]
                for line in text.splitlines() if line.startswith(("│", "┃"))]  # fmt: skip

    clock = PinnedClock()
    backend = backend_from_url("memory://top-limits", clock=clock)
    IntervalQueue("plain", interval="100ms", backend=backend).ensure()
    assert "limits" not in shown(backend)[0]
    api = IntervalQueue("api", interval="100ms", quota="5/1m", burst=2, concurrency=3, backend=backend)
    api.ensure()
    cap = IntervalQueue("cap", interval=None, concurrency=2, backend=backend)
    cap.ensure()
    for _ in range(2):
        clock.advance(us=I)
        assert api.start(api.claim()).authorized
    clock.advance(us=I)
    assert cap.start(cap.claim()).authorized
    head, *rows = shown(backend)
    by_queue = {r[0]: dict(zip(head, r, strict=True)) for r in rows}
    print(head, by_queue)
    assert head[:5] == ["queue", "rate/s", "limit/s", "of limit", "limits"]
    assert by_queue["api"]["limits"] == "2/5 in 1m, burst 2, in flight 2/3" and by_queue["api"]["limit/s"] == "10.00"
    assert by_queue["cap"]["limits"] == "in flight 1/2" and by_queue["cap"]["limit/s"] == "-"
    assert by_queue["plain"]["limits"] == "-"
    statuses = [backend.status(q) for q in ("api", "cap", "plain")]
    assert [r[2] for r in status_rows(statuses)[1:]] == [by_queue[q]["limits"] for q in ("api", "cap", "plain")]


def test_the_exporter_shows_who_waits_in_fair_lines_with_only_the_top_keys_labelled() -> None:
    """Per queue the keys and tasks waiting in its fair lines (0 for a queue with none); per
    key only the ``fair_top`` with the most waiting, so a key that drops out of them, or
    whose line empties, drops out of the next scrape: the ``key`` label stays bounded."""
    from click.testing import CliRunner

    from siq_celery.cli import siq
    from siq_celery.parked import FairTask

    backend = backend_from_url("memory://fair-metrics", clock=PinnedClock())
    backend.ensure("plain", I, "e1")

    def push(key: str, first: int, last: int) -> None:
        backend.fair_park("fair", key, 2 if key == "gold" else 1,
                          [FairTask(f"{key}{n}", "{}") for n in range(first, last + 1)], I, "e1")  # fmt: skip

    def scraped(collector: StoreCollector) -> dict[tuple[str, ...], float]:
        return {(s.name, s.labels["queue"], *([s.labels["key"]] if "key" in s.labels else [])): s.value
                for family in text_string_to_metric_families(text(collector))
                for s in family.samples if s.name.startswith("siq_fair")}  # fmt: skip

    for key, n in (("A", 5), ("gold", 4), ("C", 3), ("D", 2)):
        push(key, 0, n - 1)
    collector = StoreCollector(backend, fair_top=2)
    assert scraped(collector) == {
        ("siq_fair_keys_waiting", "fair"): 4, ("siq_fair_tasks_waiting", "fair"): 14,
        ("siq_fair_keys_waiting", "plain"): 0, ("siq_fair_tasks_waiting", "plain"): 0,
        ("siq_fair_key_waiting", "fair", "A"): 5, ("siq_fair_key_waiting", "fair", "gold"): 4,
    }  # fmt: skip
    push("C", 3, 12)  # C now waits most; gold drops out of the top 2
    backend.release("fair", 50 * I)  # the lookahead (4 tickets) to the heads: A, C, D, gold
    got = scraped(collector)
    print(got)
    assert got[("siq_fair_tasks_waiting", "fair")] == 20 and got[("siq_fair_keys_waiting", "fair")] == 4
    assert {k[2]: v for k, v in got.items() if k[0] == "siq_fair_key_waiting"} == {"C": 12, "A": 4}
    backend.set_interval("fair", 1)  # a lookahead of 250,000: every head handed a ticket
    backend.release("fair", 50 * I)
    got = scraped(collector)
    assert got[("siq_fair_keys_waiting", "fair")] == 0 and not any(k[0] == "siq_fair_key_waiting" for k in got)
    assert 'key="' not in text(StoreCollector(backend, fair_top=0))

    bad = CliRunner().invoke(siq, ["--url", "memory://fair-metrics", "exporter", "--fair-top", "-1"])
    assert bad.exit_code == 2 and "--fair-top" in bad.output
    push("B", 0, 2)
    once = CliRunner().invoke(siq, ["--url", "memory://fair-metrics", "exporter", "--once", "--fair-top", "1"])
    assert once.exit_code == 0 and 'siq_fair_key_waiting{key="B",queue="fair"} 3.0' in once.output, once.output


def test_top_shows_who_waits_in_fair_lines_below_the_queues() -> None:
    import io

    from rich.console import Console

    from siq_celery.observe.top import QueueRates, table
    from siq_celery.parked import FairTask

    backend = backend_from_url("memory://top-fair", clock=PinnedClock())
    backend.ensure("plain", I, "e1")

    def shown() -> str:
        console = Console(file=io.StringIO(), width=160, color_system=None)
        console.print(table(StoreCollector(backend, fair_top=3), QueueRates(), "*"))
        return console.file.getvalue()  # type: ignore[attr-defined, no-any-return]

    assert "fair shares" not in shown()  # no queue with tasks waiting in fair lines: no table
    for key, n in (("A", 1500), ("[b]", 3), ("c", 3), ("d", 1), ("e", 1)):
        backend.fair_park("fair", key, 2 if key == "c" else 1, [FairTask(f"{key}{i}", "{}") for i in range(n)], I,
                          "e1")  # fmt: skip
    screen = shown()
    print(screen)
    head, fair = screen.split("fair shares")
    assert "plain" in head and "fair" in head  # every queue in the first table, as before
    rows = [[c.strip() for c in line.strip("│┃ ").split("│" if "│" in line else "┃")]
            for line in fair.splitlines() if line.startswith(("│", "┃"))]  # fmt: skip
    assert rows == [
        ["queue", "keys", "tasks", "most waiting"],
        ["fair", "5", "1,508", "A 1,500 (w1), [b] 3 (w1), c 3 (w2), +2 more"],
    ]
