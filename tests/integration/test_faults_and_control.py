"""IntervalTask under pause/resume and set-interval from the CLI, a skewed producer
clock, and deferrals of a task that may not retry (worker kills: tests/faults)."""

from __future__ import annotations

import datetime
import time
from collections import Counter

import pytest

from tests.integration.conftest import CeleryRun, gaps_ms, inversions
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
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms")
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
    assert inversions(starts) == inversions(after), "none before the pause, nor across it"
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


@HOST_CLOCK_RERUNS
def test_producer_clock_five_seconds_ahead_changes_nothing_in_the_spacing(celery_run: CeleryRun) -> None:
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms")  # 50 ms, as above; rates at 20 ms are bench/'s
    celery_run.start_workers(2, 2, "prefork")
    app = celery_run.app
    real_now = app.now
    app.now = lambda: real_now() + datetime.timedelta(seconds=5)  # the producer's time source
    publish(celery_run, 100)
    starts = celery_run.wait_for_count(100, timeout=60)
    times = sorted(s["t"] for s in starts)
    print(f"smallest gap {min(gaps_ms(starts)):.2f} ms, span {times[-1] - times[0]:.3f} s")
    host_gaps_at_least(gaps_ms(starts), 45.0)
    # Bodies timed on the host clock: a head delivered late is overtaken (by design), and a
    # busy host stretches the span; both are the host's timing, rerun as such.
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
