"""Long backlogs with real workers: tasks beyond the horizon wait parked in the store and
come back in time, in order, once each (Redis broker and store)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from typing import Any

import pytest

from siq_celery import IntervalQueue
from tests.integration.conftest import CeleryRun, gaps_ms, inversions
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.processes, pytest.mark.slow, HOST_CLOCK_RERUNS]


def assert_clean(starts: list[dict[str, object]], count: int, interval_ms: float) -> None:
    assert sorted(r["n"] for r in starts) == list(range(count))  # each ran exactly once
    host_gaps_at_least(gaps_ms(starts), 0.9 * interval_ms)
    ordered = sorted(starts, key=lambda r: r["store_start_us"])  # type: ignore[arg-type, return-value]
    store_gaps = [(b["store_start_us"] - a["store_start_us"]) / 1000 for a, b in itertools.pairwise(ordered)]  # type: ignore[operator]
    assert min(store_gaps) >= interval_ms
    by_start = [r["ticket"] for r in sorted(starts, key=lambda r: r["store_start_us"])]  # type: ignore[arg-type, return-value]
    assert inversions(starts) == 0, " ".join(map(str, by_start))


def fleet(celery_run: CeleryRun, interval_ms: int, nodes: int = 2, **env: str) -> tuple[Any, IntervalQueue]:
    """``nodes`` workers x -c 2 on a fresh geo queue at ``interval_ms``; the task and its queue."""
    celery_run.env.update(SIQ_TEST_INTERVAL=f"{interval_ms}ms", **env)
    celery_run.start_workers(nodes, 2)
    record = celery_run.app.tasks["geo.record"]
    queue = record.siq_queue()
    queue.ensure(interval_ms / 1000, reset=True)
    return record, queue


def test_a_producer_parks_what_is_beyond_the_horizon_and_workers_release_it(celery_run: CeleryRun) -> None:
    record, queue = fleet(celery_run, 50, SIQ_TEST_HORIZON="2", SIQ_TEST_RELEASE_EVERY="0.5")
    for n in range(120):  # 6 s of backlog at 50 ms
        record.delay(n)
    parked = queue.status().parked
    assert parked >= 60, parked  # beyond 2 s: in the store, not in a worker
    starts = celery_run.wait_for_count(120)
    assert_clean(starts, 120, 50)
    assert queue.status().parked == 0
    print(f"\nparking: {parked} of 120 parked at publish, smallest gap {min(gaps_ms(starts)):.2f} ms")


def test_apply_many_claims_in_chunks_and_parks_the_far_ones(celery_run: CeleryRun) -> None:
    # 50 ms, as the other parking runs: at 20 ms a pool process late by an interval on a busy
    # 2-core host lets the next ticket overtake it (by design), which says nothing of parking
    record, queue = fleet(celery_run, 50, SIQ_TEST_HORIZON="2", SIQ_TEST_RELEASE_EVERY="0.5")
    results = record.apply_many([(n,) for n in range(120)], chunk_size=40)
    assert len(results) == 120 and len({r.id for r in results}) == 120
    parked = queue.status().parked
    assert 72 <= parked <= 84, parked  # 6 s of backlog in three chunks, 2 s of it within the horizon
    starts = celery_run.wait_for_count(120)
    assert_clean(starts, 120, 50)
    assert {r["task_id"] for r in starts} == {r.id for r in results}


def test_a_worker_parks_a_task_whose_slot_is_beyond_the_horizon(celery_run: CeleryRun) -> None:
    """Published before the backlog was known (no ETA), the task is parked by the worker."""
    record, queue = fleet(
        celery_run, 100, nodes=1, SIQ_TEST_HORIZON="1", SIQ_TEST_RELEASE_EVERY="0.3", SIQ_TEST_DEBUG_SIQ="1"
    )  # its "parked" line is DEBUG
    # 2 s of line ahead, claimed by another producer (never started: each costs a slot)
    IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"]).claim_many(20)
    record.delay(0)
    deadline = time.monotonic() + 10
    while queue.status().parked == 0:
        assert time.monotonic() < deadline, "not parked"
        time.sleep(0.05)
    [start] = celery_run.wait_for_count(1, timeout=30)
    assert start["ticket"] == 21 and start["header_ticket"] == 21
    log = "".join(w.log() for w in celery_run.workers)
    assert "ticket 21 of 'geo' parked" in log, log[-3000:]


@pytest.mark.timeout(400)
def test_a_backlog_six_times_the_visibility_timeout_runs_each_task_once(celery_run: CeleryRun) -> None:
    """Without parking, tasks held by ETA for up to 30 s would be redelivered after 5 s."""
    celery_run.env.update(
        SIQ_TEST_INTERVAL="50ms", SIQ_TEST_HORIZON="2", SIQ_TEST_RELEASE_EVERY="0.5",
        SIQ_TEST_TRANSPORT=json.dumps({"visibility_timeout": 5, "unacked_restore_interval": 1}),
    )  # fmt: skip
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.05, reset=True)
    record.apply_many([(n,) for n in range(600)])  # 30 s of backlog
    starts = celery_run.wait_for_count(600, timeout=100)
    time.sleep(2)  # one more restore sweep: a redelivered copy would start now
    starts = celery_run.starts()
    assert len(starts) == 600 and len({r["task_id"] for r in starts}) == 600  # 0 duplicate starts
    assert_clean(starts, 600, 50)
    print(f"\nvisibility 5 s, 600 tasks over {(max(r['t'] for r in starts) - min(r['t'] for r in starts)):.0f} s: "
          f"0 duplicates, smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip


@pytest.mark.timeout(400)
def test_workers_stopped_for_a_minute_then_everything_runs_in_ticket_order(celery_run: CeleryRun) -> None:
    record, queue = fleet(celery_run, 50, SIQ_TEST_HORIZON="2", SIQ_TEST_RELEASE_EVERY="0.5")
    record.apply_many([(n,) for n in range(200)])  # 10 s of backlog: most of it parked
    celery_run.wait_for_count(40)
    workers = list(celery_run.workers)
    for w in workers:  # all at once (one by one, a stopping node holds its ETA tasks while the rest go on)
        w.request_stop()  # warm shutdown: tasks held by ETA go back to the broker unacknowledged
    for w in workers:
        w.stop()
    stopped = time.monotonic()
    before = len(celery_run.starts())
    status = queue.status()
    assert status.parked > 0 and before < 200
    time.sleep(max(0.0, float(os.environ.get("SIQ_TEST_OUTAGE_S", "60")) - (time.monotonic() - stopped)))
    assert len(celery_run.starts()) == before  # nothing ran meanwhile
    celery_run.workers.clear()
    celery_run.start_workers(2, 2)
    starts = celery_run.wait_for_count(200, timeout=120)
    if os.environ.get("SIQ_TEST_DEBUG"):
        ordered = sorted(starts, key=lambda r: r["store_start_us"])
        late = [r for i, r in enumerate(ordered) if any(o["ticket"] > r["ticket"] for o in ordered[:i])]
        twice = [r for r in ordered if sum(o["task_id"] == r["task_id"] for o in ordered) > 1]
        for r in late[:3] + twice:
            print(r["ticket"], r["task_id"], r["node"])
            for w in celery_run.workers + workers:
                print("\n".join(line for line in w.log().splitlines() if r["task_id"] in line))
    assert_clean(starts, 200, 50)  # every task once, in ticket order, at the interval
    outage = os.environ.get("SIQ_TEST_OUTAGE_S", "60")
    print(f"\nstopped {outage} s with {status.parked} parked and {200 - before - status.parked} in the broker: "
          f"all 200 ran once, 0 inversions")  # fmt: skip


def _rabbitmq_env(name: str, value: int | None = None) -> int:
    """Read (and with ``value``, set) one of the RabbitMQ server's settings at runtime
    (``consumer_timeout`` in ms; ``channel_tick_interval``, how often, in ms, a channel checks
    its consumers' timeouts: a minute unless set, read by each channel as it opens)."""
    command = f"application:get_env(rabbit, {name})."
    if value is not None:
        command = f"application:set_env(rabbit, {name}, {value}), {command}"
    out = subprocess.run(["rabbitmqctl", "eval", command], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.fail(f"cannot read or set RabbitMQ's {name} with rabbitmqctl: {out.stderr.strip()[:200]}")
    return int(out.stdout.split("{ok,")[1].split("}")[0]) if "{ok," in out.stdout else -1


def _rabbitmq_restore(name: str, before: int) -> None:
    unset = f"application:unset_env(rabbit, {name})."
    command = f"application:set_env(rabbit, {name}, {before})." if before >= 0 else unset
    subprocess.run(["rabbitmqctl", "eval", command], capture_output=True, text=True, timeout=30, check=True)


@pytest.mark.rabbitmq
@pytest.mark.timeout(400)
def test_rabbitmq_backlog_longer_than_consumer_timeout_keeps_its_channel(celery_run: CeleryRun, amqp_url: str) -> None:
    """consumer_timeout 5 s on the server, checked every second (both set at runtime, for the
    channels the workers open, and restored after), a 30 s backlog: no task is held
    unacknowledged near that long, so no channel is closed. (With siq_horizon 600 s the same
    run ends in "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out" and a
    dead worker within seconds.)"""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not on PATH: cannot set the server's consumer_timeout")
    timeout_before, tick_before = _rabbitmq_env("consumer_timeout"), _rabbitmq_env("channel_tick_interval")
    try:
        assert _rabbitmq_env("consumer_timeout", 5_000) == 5_000
        assert _rabbitmq_env("channel_tick_interval", 1_000) == 1_000
        celery_run.env.update(SIQ_TEST_BROKER=amqp_url, SIQ_TEST_INTERVAL="100ms", SIQ_TEST_HORIZON="2",
                              SIQ_TEST_RELEASE_EVERY="0.5")  # fmt: skip
        celery_run.start_workers(2, 2)
        record = celery_run.app.tasks["geo.record"]
        record.siq_queue().ensure(0.1, reset=True)
        record.apply_many([(n,) for n in range(300)])
        starts = celery_run.wait_for_count(300, timeout=120)
    finally:
        _rabbitmq_restore("consumer_timeout", timeout_before)
        _rabbitmq_restore("channel_tick_interval", tick_before)
    assert len(starts) == 300 and len({r["task_id"] for r in starts}) == 300
    logs = "".join(w.log() for w in celery_run.workers)
    assert "PRECONDITION_FAILED" not in logs and "timed out" not in logs.lower(), logs[-3000:]
    assert all(w.alive for w in celery_run.workers)
    print(
        f"\nRabbitMQ consumer_timeout 5 s checked every 1 s, 300 tasks over {starts[-1]['t'] - starts[0]['t']:.0f} s: "
        "no channel error"
    )


def test_pool_processes_stay_flat_through_thousands_of_deferrals(celery_run: CeleryRun) -> None:
    """Each deferral ends in Celery's Ignore, whose traceback copy is cyclic garbage (about
    20 KB to 200 KB); siq_celery collects it every 20 deferrals."""
    import psutil

    celery_run.env.update(SIQ_TEST_PAUSED_POLL="0.1", SIQ_TEST_DEBUG_SIQ="1")  # a DEBUG line per deferral, counted
    [worker] = celery_run.start_workers(1, 2)
    record = celery_run.app.tasks["geo.record"]
    queue = record.siq_queue()
    queue.ensure(0.02, reset=True)
    assert worker.process is not None
    children = psutil.Process(worker.process.pid).children()
    baseline = max(c.memory_info().rss for c in children)
    queue.pause()
    for n in range(40):  # 40 tasks polling a paused queue every 0.1 s: 400 deferrals a second
        record.delay(n)
    # Until 2000 deferrals (about 5 s at 400 a second; a slow machine takes longer: the
    # memory claim is per deferral, not per second).
    peak, started, deferrals = baseline, time.monotonic(), 0
    while deferrals < 2000 and time.monotonic() - started < 60:
        for _ in range(5):
            peak = max([peak, *(c.memory_info().rss for c in children)])
            time.sleep(0.2)
        deferrals = sum(w.log().count("deferred") for w in celery_run.workers)
    queue.resume(grace=0.2)
    celery_run.wait_for_count(40)
    print(f"\n{deferrals} deferrals: pool process peak {peak / 2**20:.1f} MB, baseline {baseline / 2**20:.1f} MB")
    assert deferrals >= 2000
    assert peak - baseline < 20 * 2**20
