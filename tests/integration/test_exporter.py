"""``siq exporter`` scraped during a real run of workers: its counters agree with the
ledger of the same run, its gauges follow the queue (backlog, pause), and it survives
the store going away."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from siq_celery.backends import backend_from_url
from siq_celery.embedded import EmbeddedRedis, free_port
from tests.integration.conftest import ROOT, CeleryRun, used_starts

pytestmark = [pytest.mark.processes, pytest.mark.slow]

TASKS = 80
SIQ = str(Path(sys.executable).parent / "siq")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def start_exporter(url: str, port: int, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [SIQ, "--url", url, "exporter", "--port", str(port), "--addr", "127.0.0.1", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            scrape(port)
            return proc
        except OSError:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
    proc.kill()
    proc.communicate()
    raise AssertionError("the exporter did not serve /metrics within 30 s")


def test_the_exporter_counts_what_the_ledger_holds(celery_run: CeleryRun) -> None:
    store = celery_run.env["SIQ_TEST_STORE"]
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.05, reset=True)
    port = free_port()
    exporter = start_exporter(store, port, "geo*")
    try:
        for n in range(TASKS):
            record.delay(n)
        first = scrape(port)
        assert sample(first, "siq_up") == 1
        assert sample(first, "siq_queue_interval_seconds", queue="geo") == pytest.approx(0.05)
        assert sample(first, "siq_queue_backlog_tickets", queue="geo") > 10  # 4 s of work claimed up front
        assert sample(first, "siq_queue_drain_seconds", queue="geo") > 0.5

        celery_run.wait_for(lambda s: len(s) >= 20, 30, "20 starts")
        celery_run.siq("pause", "geo")
        paused = scrape(port)
        assert sample(paused, "siq_queue_paused", queue="geo") == 1
        celery_run.siq("resume", "geo")
        assert sample(scrape(port), "siq_queue_paused", queue="geo") == 0

        celery_run.wait_for_count(TASKS, timeout=60)
        time.sleep(0.3)  # the last start's ledger entry is written before its body runs
        done = scrape(port)
    finally:
        exporter.terminate()
        exporter.communicate(timeout=10)
    ledger = list(backend_from_url(store).ledger("geo"))
    assert len(used_starts(ledger)) == TASKS
    starts = sample(done, "siq_starts_total", queue="geo")
    assert starts == len(ledger)  # counted across six scrapes, each reading only what was new
    assert sample(done, "siq_start_lateness_seconds_count", queue="geo") == starts
    assert sample(done, "siq_start_lateness_seconds_bucket", queue="geo", le="+Inf") == starts
    late = sum(max(0, r.start_us - r.slot_us) for r in ledger) / 1e6
    assert sample(done, "siq_start_lateness_seconds_sum", queue="geo") == pytest.approx(late, abs=1e-6)
    assert sample(done, "siq_gaps_below_interval_total", queue="geo") == 0
    assert sample(done, "siq_duplicates_refused_total", queue="geo") == 0
    assert sample(done, "siq_reclaims_total", queue="geo") == 0
    assert sample(done, "siq_deferrals_total", queue="geo") == sum(r.deferrals for r in ledger)
    assert sample(done, "siq_queue_backlog_tickets", queue="geo") == 0
    assert sample(done, "siq_queue_drain_seconds", queue="geo") == 0
    [epoch] = {r.epoch for r in ledger}
    assert sample(done, "siq_queue_epoch_info", queue="geo", epoch=epoch) == 1


def test_a_store_that_goes_away_reads_as_down_not_as_a_crash(tmp_path: Path) -> None:
    with EmbeddedRedis() as server:
        backend = backend_from_url(server.url)
        for name in ("api", "shop:1", "shop:2", "shop:3"):
            backend.ensure(name, 100_000, "e1")
        port = free_port()
        exporter = start_exporter(server.url, port, "--max-queues", "2")
        try:
            up = scrape(port)
            assert sample(up, "siq_up") == 1 and sample(up, "siq_queues") == 2
            assert sample(up, "siq_queues_left_out") == 2
            assert {lab for (name, lab) in up if name == "siq_queue_paused"} == {
                (("queue", "api"),),
                (("queue", "shop:1"),),
            }
            backend.client.set(backend.keys("shop:1").state, "not a hash")  # a corrupt state
            corrupt = scrape(port)
            assert sample(corrupt, "siq_queue_errors_total", queue="shop:1") == 1
            assert sample(corrupt, "siq_queue_paused", queue="api") == 0  # the others go on
            server.stop()
            down = scrape(port)
            assert sample(down, "siq_up") == 0
            assert exporter.poll() is None
        finally:
            exporter.terminate()
            _, err = exporter.communicate(timeout=10)
    assert "cannot reach" in err


def test_an_exporter_started_before_its_store_serves_down_and_recovers() -> None:
    """A store that is not up yet (a deploy starting everything at once) is one line on
    stderr and ``siq_up 0``, as when it dies later; once it answers, its queues appear."""
    server = EmbeddedRedis()
    port = free_port()
    exporter = start_exporter(server.url, port, "--max-queues", "5")
    try:
        down = scrape(port)
        assert sample(down, "siq_up") == 0 and exporter.poll() is None
        server.start()
        backend_from_url(server.url).ensure("api", 100_000, "e1")
        up = scrape(port)
        assert sample(up, "siq_up") == 1 and sample(up, "siq_queue_paused", queue="api") == 0
    finally:
        exporter.terminate()
        _, err = exporter.communicate(timeout=10)
        server.stop()
    print(err)
    assert "cannot reach" in err and "Traceback" not in err


def test_an_exporter_once_on_an_unreachable_store_is_a_clear_error() -> None:
    result = subprocess.run(
        [SIQ, "--url", f"redis://127.0.0.1:{free_port()}/0", "exporter", "--once"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("Error: ") and "cannot reach" in result.stderr, result.stderr


def test_a_worker_serves_the_same_metrics_when_asked(celery_run: CeleryRun) -> None:
    """``siq_metrics_port``: the main process of a prefork worker serves the metrics; a
    second node on the same host and port logs why it cannot, and runs its tasks."""
    port = free_port()
    env = {"SIQ_TEST_METRICS_PORT": str(port)}
    first = celery_run.start_worker("node0", 2, env=env)
    first.wait_ready()
    second = celery_run.start_worker("node1", 2, env=env)
    second.wait_ready()
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.02, reset=True)
    for n in range(30):
        record.delay(n)
    starts = celery_run.wait_for_count(30, timeout=30)
    time.sleep(0.3)
    samples = scrape(port)
    assert sample(samples, "siq_queue_interval_seconds", queue="geo") == pytest.approx(0.02)
    assert sample(samples, "siq_starts_total", queue="geo") == 30
    assert {s["node"] for s in starts} == {"node0@siq-test", "node1@siq-test"}
    assert "cannot serve metrics on port" in second.log()
