"""IntervalTask under pause/resume and set-interval from the CLI, a skewed producer
clock, and deferrals of a task that may not retry (worker kills: tests/faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.conftest import ROOT, CeleryRun, gaps_ms, inversions, overtaken_on_time
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

# Real processes timed on the host clock of a 2-core shared machine: a rare scheduling
# spike of a few ms can delay one body past the bound. Such a test runs at most three times more
# (same tolerances; a real defect fails three times; pytest -ra lists every rerun).
pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]


def publish(run: CeleryRun, count: int, task: str = "geo.record", **kwargs: object) -> None:
    t = run.app.tasks[task]
    for n in range(count):
        t.apply_async((n,), kwargs or None)


def test_pause_and_resume_from_the_cli_mid_run(celery_run: CeleryRun) -> None:
    # 50 ms: at 20 ms, with every task deferred by the pause, a resumed backlog of ~190 on
    # 2 x -c 2 here started 2-17 % of its tickets out of order (docs/design.md, "The model": pause and resume)
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms", SIQ_TEST_TRACE_PRERUN="1")  # when each task reached the gate
    celery_run.start_workers(2, 2, "prefork")
    publish(celery_run, 120)  # 6 s at 50 ms: the CLI takes a second or two to start on a busy host
    celery_run.wait_for(lambda s: len(s) >= 30, 30, "30 starts")
    assert "paused geo" in celery_run.siq("pause", "geo")
    paused_at = time.time()
    time.sleep(2.0)
    status = celery_run.siq("status", "geo")
    header, row = status.splitlines()[:2]
    assert row.split()[header.split().index("paused")] == "yes"
    resumed_at = time.time()
    assert "resumed geo" in celery_run.siq("resume", "geo")
    starts = celery_run.wait_for_count(120)
    during = [s for s in starts if paused_at < s["t"] < resumed_at]
    after = [s for s in starts if s["t"] >= resumed_at]
    print(f"{len(starts) - len(during) - len(after)} starts before the pause, {len(during)} during, "
          f"{len(after)} after; inversions {inversions(starts)}")  # fmt: skip
    assert during == []
    assert len(after) >= 30, "the pause came mid-run"
    assert sorted(s["n"] for s in starts) == list(range(120))
    ordered = sorted(after, key=lambda s: s["store_start_us"])
    dump = " ".join(f"{s['ticket']}@{(s['store_start_us'] - ordered[0]['store_start_us']) / 1000:.0f}" for s in ordered)
    if inversions(after):
        highest, late = 0, []
        for s in ordered:
            if s["ticket"] < highest:
                late.append(s)
            highest = max(highest, s["ticket"])
        for s in late[:2]:
            print("overtaken", s)
            for w in celery_run.workers:
                for line in w.log().splitlines():
                    if s["task_id"] in line or f"ticket {s['ticket']} of" in line:
                        print(w.name, line[:200])
        print("resumed_at", resumed_at, "paused_at", paused_at)
    # Open deviation (docs/design.md, "The model": pause and resume): a resumed line's head
    # can come back after its slot and be overtaken; seen once in 5 runs at 50 ms (43 before
    # 42, 50 ms apart). Bounded here at 2 % of the resumed starts; none before the pause.
    bound = max(1, len(after) // 50)
    assert inversions(after) <= bound, f"the rest started in ticket order: {dump}"
    # None across the pause. Before it, only a ticket whose task reached the gate after the
    # overtaking start was authorized may be overtaken (a head delivered late: by design,
    # docs/design.md, "The guarantees"): on a loaded CI host, the first ticket of a run,
    # delivered to a pool process still starting, was overtaken by the second.
    before = [s for s in starts if s["t"] < paused_at]
    assert inversions(starts) == inversions(before) + inversions(after), "none across the pause"
    wrong = overtaken_on_time(before, celery_run.preruns())
    host_clock(not wrong, "overtaken at the gate before the pause:\n" + "\n".join(wrong))
    host_gaps_at_least(gaps_ms(starts), 45.0)


def test_set_interval_from_the_cli_applies_from_the_next_start(celery_run: CeleryRun) -> None:
    # 50 ms, not 20: bodies start up to 2-2.5 ms after their authorization now and then on
    # this host, which took a 20 ms gap below 0.9 I in three attempts running (2026-11-26).
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms")
    celery_run.start_workers(2, 2, "prefork")
    publish(celery_run, 70)  # 3.5 s at 50 ms: the CLI itself takes about a second to start
    celery_run.wait_for(lambda s: len(s) >= 10, 30, "10 starts")
    celery_run.siq("set-interval", "geo", "150ms")
    changed_at = time.time()
    starts = sorted(celery_run.wait_for_count(70, timeout=60), key=lambda s: s["t"])
    later = [s for s in starts if s["t"] > changed_at]
    assert len(later) >= 10
    slow_gaps = gaps_ms(later)
    print(f"{len(later)} starts after the change, gaps {min(slow_gaps):.1f}-{max(slow_gaps):.1f} ms")
    host_gaps_at_least(slow_gaps, 135.0)  # 0.9 x the new interval, from the first start after the change
    host_gaps_at_least(gaps_ms(starts), 45.0)


#: The producer of the test below: a process whose wall clock reads 5 s ahead, every way
#: Python reads it (``time.time``, ``time_ns``, ``datetime.now``, ``utcnow`` and ``today``,
#: so Celery's ``app.now`` too, which turns a countdown into an ETA), shifted before
#: anything is imported; it publishes 100 tasks.
SKEWED_PRODUCER = """
import datetime, json, time
real_time, real_time_ns = time.time, time.time_ns
time.time = lambda: real_time() + 5.0
time.time_ns = lambda: real_time_ns() + 5_000_000_000

class Ahead(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp(time.time(), tz)

    @classmethod
    def utcnow(cls):
        return cls.now(datetime.UTC).replace(tzinfo=None)

    @classmethod
    def today(cls):
        return cls.now()

datetime.datetime = Ahead
from tests.apps.geo import app

real_now = Ahead.fromtimestamp(real_time(), datetime.UTC)
seen = {"began": real_time(), "time_ahead": time.time() - real_time(),
        "datetime_ahead": (datetime.datetime.now(datetime.UTC) - real_now).total_seconds(),
        "app_now_ahead": (app.now() - real_now).total_seconds()}
for n in range(100):
    app.tasks["geo.record"].apply_async((n,))
seen["ended"] = real_time()
print(json.dumps(seen))
"""


@HOST_CLOCK_RERUNS
def test_producer_clock_five_seconds_ahead_changes_nothing_in_the_spacing(celery_run: CeleryRun) -> None:
    """ETAs come from the store's clock: a producer whose host clock is 5 s ahead gets its
    tasks started on time. (An ETA read on the producer's clock, its own or Celery's from a
    countdown, would hold every task 5 s past its slot.)"""
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms")  # 50 ms, as above; rates at 20 ms are bench/'s
    celery_run.start_workers(2, 2, "prefork")
    producer = subprocess.run(
        [sys.executable, "-c", SKEWED_PRODUCER], env={**os.environ, **celery_run.env}, cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert producer.returncode == 0, producer.stderr
    seen = json.loads(producer.stdout.splitlines()[-1])
    for clock in ("time_ahead", "datetime_ahead", "app_now_ahead"):
        assert seen[clock] == pytest.approx(5, abs=0.1), seen
    starts = celery_run.wait_for_count(100, timeout=60)
    times = sorted(s["t"] for s in starts)
    hole = max(gaps_ms(starts))
    print(f"published in {seen['ended'] - seen['began']:.3f} s; first start {times[0] - seen['began']:.3f} s after "
          f"the first publish, largest gap {hole:.1f} ms, span {times[-1] - times[0]:.3f} s")  # fmt: skip
    # Bodies timed on the host clock: a head delivered late is overtaken (by design), and a
    # busy host stretches the span; both are the host's timing, rerun as such. (A task held
    # by a producer's clock leaves a hole of 5 s, whatever the host's load.)
    host_clock(hole < 2500, f"a hole of {hole:.0f} ms between starts: tasks held past their slots")
    host_gaps_at_least(gaps_ms(starts), 45.0)
    host_clock(inversions(starts) == 0, f"{inversions(starts)} inversion(s): a head delivered late was overtaken")
    span = times[-1] - times[0]
    host_clock(span <= 1.05 * 99 * 0.050, f"100 starts at 50 ms took {span:.3f} s on the host clock (> 5.198 s)")


def test_a_task_with_max_retries_0_deferred_many_times_still_runs(celery_run: CeleryRun) -> None:
    celery_run.env["SIQ_TEST_RESULTS"] = celery_run.env["SIQ_TEST_STORE"].rsplit("/", 1)[0] + "/4"
    celery_run.env["SIQ_TEST_DEBUG_SIQ"] = "1"  # a DEBUG line per deferral, counted
    celery_run.start_workers(1, 2, "prefork")
    celery_run.siq("status")  # nothing yet: the command works on an empty store
    task = celery_run.app.tasks["geo.no_retries"]
    first = task.delay(0)
    assert first.get(timeout=30) == 0
    celery_run.siq("pause", "geo")
    results = [task.delay(n) for n in range(1, 4)]
    time.sleep(3.0)  # paused for 3 s: every task is deferred about 6 times (poll 0.5 s)
    assert all(r.state != "FAILURE" for r in results)
    celery_run.siq("resume", "geo")
    assert [r.get(timeout=30) for r in results] == [1, 2, 3]
    starts = celery_run.starts()
    assert sorted(s["n"] for s in starts) == [0, 1, 2, 3] and {s["retries"] for s in starts} == {0}
    deferrals = sum(w.log().count("paused; ticket") for w in celery_run.workers)
    print(f"{deferrals} deferrals, states {[r.state for r in results]}")
    assert deferrals >= 6


def test_a_retry_is_a_new_start_with_a_new_ticket(celery_run: CeleryRun) -> None:
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms")  # at 20 ms it needed a rerun (18.0 ms bound) in CI
    celery_run.start_workers(1, 2, "prefork")
    task = celery_run.app.tasks["geo.retry_once"]
    for n in range(5):
        task.delay(n)
    starts = celery_run.wait_for(lambda s: len(s) >= 10, 60, "5 tasks x 2 starts")
    assert Counter(s["n"] for s in starts) == {n: 2 for n in range(5)}
    assert len({s["ticket"] for s in starts}) == 10  # every start its own ticket
    host_gaps_at_least(gaps_ms(starts), 45.0)
