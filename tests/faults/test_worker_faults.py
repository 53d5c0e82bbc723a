"""Workers die, stop, or lose track of time while they hold interval tasks.

A waiting task holds a ticket; a running one has used its slot. Whatever happens to the
worker, the line must go on at the interval (no gap below 0.9 x interval), and the
broker's redelivery must bring every task to exactly one finish.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections import Counter
from typing import Any

import pytest

from siq_celery.workers import WorkerProcess
from tests.faults.conftest import publish, wait_finished
from tests.integration.conftest import CeleryRun, gaps_ms, inversions
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults, HOST_CLOCK_RERUNS]


def waiting_on(run: CeleryRun, node: str) -> set[str]:
    """Task ids ``node`` has taken into its trace but not started: waiting for their slot."""
    started = {s["task_id"] for s in run.starts()}
    return {p["task_id"] for p in run.preruns() if p["node"] == node and p["task_id"] not in started}


def running_on(run: CeleryRun, node: str) -> set[int]:
    finished = {f["n"] for f in run.finishes()}
    return {s["n"] for s in run.starts() if s["node"] == node and s["n"] not in finished}


def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sleepy_fleet(run: CeleryRun) -> tuple[WorkerProcess, WorkerProcess]:
    """200 ms, tasks brought 1 s before their slot and slept in the worker: at any moment
    several pool processes are waiting for a slot."""
    run.env.update(SIQ_TEST_INTERVAL="200ms", SIQ_TEST_MARGIN="1.0", SIQ_TEST_MAX_SLEEP="3", SIQ_TEST_TRACE_PRERUN="1")
    survivor = run.start_worker("survivor", 2)
    victim = run.start_worker("victim", 4)
    survivor.wait_ready()
    victim.wait_ready()
    return survivor, victim


def test_sigkill_while_tasks_sleep_before_their_slot(fault_run: CeleryRun) -> None:
    _, victim = sleepy_fleet(fault_run)
    publish(fault_run, range(40))
    fault_run.wait_for(lambda s: len(s) >= 8, 30, "8 starts")
    until(lambda: waiting_on(fault_run, victim.name), 10, "the victim to be waiting for a slot")
    victim.kill()
    killed_at = time.time()
    sleeping = waiting_on(fault_run, victim.name)
    finishes = wait_finished(fault_run, 40, 60)
    starts = fault_run.starts()
    rerun = [s for s in starts if s["task_id"] in sleeping]
    print(f"\n{len(sleeping)} tasks waiting for their slot when killed; started again after "
          f"{min(s['t'] for s in rerun) - killed_at:.1f} s on {sorted({s['node'] for s in rerun})}; "
          f"smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip
    assert sleeping, "the kill hit tasks waiting for their slot"
    assert sorted(finishes) == list(range(40)) and max(finishes.values()) == 1
    assert {s["node"] for s in rerun} == {"survivor@siq-test"} and len(rerun) == len(sleeping)
    host_gaps_at_least(gaps_ms(starts), 180.0)


@pytest.mark.parametrize("durability", ["app settings", "IntervalTask defaults"])
def test_sigkill_while_bodies_run(fault_run: CeleryRun, durability: str) -> None:
    """Nothing is lost whether the app sets acks_late and reject_on_worker_lost or, like a
    plain Celery() app, says nothing (IntervalTask is durable by default)."""
    fault_run.env.update(SIQ_TEST_INTERVAL="100ms")
    if durability == "IntervalTask defaults":
        fault_run.env.update(SIQ_TEST_CELERY_DEFAULTS="1")
    fault_run.start_worker("survivor", 2).wait_ready()
    victim = fault_run.start_worker("victim", 4).wait_ready()
    publish(fault_run, range(40), work=0.5)
    until(lambda: len(running_on(fault_run, victim.name)) >= 2, 30, "two bodies running on the victim")
    victim.kill()
    interrupted = running_on(fault_run, victim.name)
    finishes = wait_finished(fault_run, 40, 90)
    starts = fault_run.starts()
    twice = sorted(n for n, c in Counter(s["n"] for s in starts).items() if c > 1)
    print(f"\nkilled with {sorted(interrupted)} running; started twice: {twice}; "
          f"smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip
    assert sorted(finishes) == list(range(40)) and max(finishes.values()) == 1, "every task finished once"
    assert set(twice) == interrupted, "an interrupted body runs again (at least once), nothing else does"
    host_gaps_at_least(gaps_ms(starts), 90.0)  # the re-run took a slot of its own


def test_sigterm_warm_shutdown_with_tasks_waiting(fault_run: CeleryRun) -> None:
    survivor, victim = sleepy_fleet(fault_run)
    publish(fault_run, range(40))
    fault_run.wait_for(lambda s: len(s) >= 8, 30, "8 starts")
    until(lambda: waiting_on(fault_run, victim.name), 10, "the victim to be waiting for a slot")
    assert victim.process is not None
    os.kill(victim.process.pid, signal.SIGTERM)  # the main process: Celery's warm shutdown
    stopped_at = time.monotonic()
    waiting = waiting_on(fault_run, victim.name)
    code = victim.process.wait(30)
    took = time.monotonic() - stopped_at
    finishes = wait_finished(fault_run, 40, 60)
    starts = fault_run.starts()
    by_victim = {s["task_id"] for s in starts if s["node"] == victim.name}
    print(f"\nwarm shutdown in {took:.1f} s (exit {code}) with {len(waiting)} tasks waiting for their slot; "
          f"{sum(1 for s in starts if s['node'] == survivor.name)} starts on the survivor; "
          f"smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip
    assert code == 0
    assert waiting and waiting <= by_victim, "the tasks it was waiting with started before it stopped"
    assert sorted(finishes) == list(range(40)) and max(finishes.values()) == 1, "the rest went to the survivor"
    host_gaps_at_least(gaps_ms(starts), 180.0)


def test_a_fleet_paused_killed_stopped_and_joined_runs_every_task_once(fault_run: CeleryRun) -> None:
    """As an operator's day goes, on a plain Celery() app: five nodes at 50 ms; the queue
    paused for 2 s and resumed; a node SIGKILLed (what it held returns when the broker's
    visibility timeout expires, with its tickets: late ones take the next free slots);
    another stopped warm; a new node joins. Every task finishes once and no two starts of
    the store are closer than the interval."""
    fault_run.env.update(SIQ_TEST_CELERY_DEFAULTS="1")
    nodes = fault_run.start_workers(5, 2)
    publish(fault_run, range(200), work=0.03)
    fault_run.wait_for(lambda s: len(s) >= 30, 60, "30 starts")
    fault_run.siq("pause", "geo")
    time.sleep(2.0)
    fault_run.siq("resume", "geo")
    fault_run.wait_for(lambda s: len(s) >= 70, 60, "70 starts")
    nodes[1].kill()
    fault_run.wait_for(lambda s: len(s) >= 100, 60, "100 starts")
    nodes[2].stop()
    fault_run.start_worker("joined", 2).wait_ready()
    finishes = wait_finished(fault_run, 200, 120)
    starts = fault_run.starts()
    authorized = sorted(s["store_start_us"] for s in starts)
    closest = min(b - a for a, b in itertools.pairwise(authorized)) / 1000
    twice = sorted(n for n, c in Counter(s["n"] for s in starts).items() if c > 1)
    print(f"\n{len(starts)} starts; started twice: {twice}; closest authorized starts {closest:.2f} ms; "
          f"{inversions(starts)} order inversions (late tickets)")  # fmt: skip
    assert sorted(finishes) == list(range(200)) and max(finishes.values()) == 1, "every task finished once"
    assert closest >= 50.0, "the store never authorized two starts closer than the interval"


@pytest.mark.parametrize("jump", ["+180", "-180"])
def test_a_worker_host_clock_jumps_minutes(fault_run: CeleryRun, jump: str) -> None:
    """One of two workers' wall clock jumps 3 minutes, 4 s after it starts. The store's
    clock decides every start, so the cap holds; the worker notices the skew within a
    second and reads ETAs on the store's clock, so its tasks are not held or bounced."""
    fault_run.start_worker("steady", 2).wait_ready()
    skewed = fault_run.start_worker(
        "skewed",
        2,
        env={"SIQ_TEST_CLOCK_JUMP": f"{jump}@4", "SIQ_TEST_DEBUG_SIQ": "1"},  # its deferrals counted
    ).wait_ready()
    published_at = time.time()
    for burst in range(8):  # 20 tasks a second, 8 s at 50 ms: the jump comes in the middle
        publish(fault_run, range(20 * burst, 20 * burst + 20))
        time.sleep(max(published_at + burst + 1 - time.time(), 0))
    finishes = wait_finished(fault_run, 160, 120)
    took = max(f["t"] for f in fault_run.finishes()) - published_at
    starts = fault_run.starts()
    per_node = Counter(s["node"] for s in starts)
    deferred = [line for line in skewed.log().splitlines() if "deferred" in line]
    # A copy of a task still waiting or running, handed out by a broker sweep (the other
    # worker's, or the skewed one's after +180) that read a stamp on the wrong clock, is
    # answered RUNNING and deferred (then refused): counted apart from the ETA's deferrals.
    copies = sum(": running;" in line for line in deferred)
    deferrals = len(deferred) - copies
    warned = "clock is" in skewed.log()
    print(f"\n{jump} s: starts per node {dict(per_node)}, {deferrals} deferrals on the skewed worker (and {copies} "
          f"redelivered copies held while their task ran), "
          f"skew warned {warned}, all done in {took:.1f} s, "
          f"smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip
    assert sorted(finishes) == list(range(160)) and max(finishes.values()) == 1
    host_gaps_at_least(gaps_ms(starts), 45.0)
    # ETAs read on the store's clock: the skewed worker neither holds tasks minutes too
    # long (-180) nor takes them early and sends them back (+180). Its unacknowledged
    # messages stamped on the store's clock: not handed out again while they wait or run
    # (stamped on its own, -180 made 9-35 copies in each run on a loaded host).
    # An ETA read on the wrong clock defers about every task of the worker (some 80); a
    # loaded host defers a few more tasks that reached the gate early (13 seen, beside the
    # untimed part of the suite): above 10 is the host's timing, above 40 a defect.
    assert warned and deferrals <= 40, "\n".join(line for line in deferred if ": running;" not in line)
    host_clock(deferrals <= 10, f"{deferrals} deferrals on the skewed worker")
    assert copies <= 10, "\n".join(line for line in deferred if ": running;" in line)
    host_clock(took < 20.0, f"the jumped worker took {took:.1f} s")


def test_a_task_that_kills_its_pool_process_fails_after_the_limit_and_the_queue_goes_on(
    fault_run: CeleryRun,
) -> None:
    """A poison message under the durable defaults (acks_late, reject_on_worker_lost): its
    body kills its prefork process each time it runs, so the broker hands it back each
    time. It starts ``siq_max_lost_deliveries`` (3) times, then the next delivery is
    refused: FAILURE in the result backend with LostDeliveriesError, one log line, never
    started again; every other task of the queue runs once. (Each copy waits for the dead
    run's lease to expire: 2 s here.)"""
    fault_run.env.update(
        SIQ_TEST_RESULTS=fault_run.env["SIQ_TEST_RECORD"].rsplit("/", 1)[0] + "/1", SIQ_TEST_LEASE_TIMEOUT="2"
    )
    worker = fault_run.start_worker("node", 2).wait_ready()
    poison = fault_run.app.tasks["geo.crash"].apply_async((-1,))
    publish(fault_run, range(20))
    deadline = time.monotonic() + 60
    while poison.state != "FAILURE" and time.monotonic() < deadline:
        time.sleep(0.2)
    finishes = wait_finished(fault_run, 20, 60)
    time.sleep(3.0)  # long enough for a loop to show: a redelivery comes back within a second
    crashes = [s for s in fault_run.starts() if s["n"] == -1]
    # One ERROR line says why (Celery's own record of the outcome follows at INFO, no traceback).
    refusals = [line for line in worker.log().splitlines() if "siq_max_lost_deliveries" in line and "ERROR" in line]
    print(f"\npoison task: state {poison.state}, started {len(crashes)} times, {len(refusals)} refusal lines; "
          f"{len(finishes)} other tasks finished")  # fmt: skip
    assert poison.state == "FAILURE", f"the poison task is {poison.state} after {len(crashes)} starts"
    assert type(poison.result).__name__ == "LostDeliveriesError" and poison.id in str(poison.result)
    assert len(crashes) == 3, "three lost deliveries, then refused, never started again"
    assert len(refusals) == 1, refusals
    assert sorted(finishes) == list(range(20)) and max(finishes.values()) == 1, "every other task ran once"


def test_sigkill_mid_body_under_a_concurrency_cap(fault_run: CeleryRun) -> None:
    """Acceptance 2's fault, scaled: concurrency 3 on 3 nodes x -c 4, 200 ms bodies, a 3 s
    lease timeout; a node SIGKILLed while its bodies run. Every task completes once, the
    leases of the dead bodies come back (on the store's clock) within the timeout + 1 s of
    the kill, and in flight (as the bodies count it) stays at most 3 throughout."""
    import redis

    from tests.integration.test_limits import most_in_flight

    timeout = 3.0
    fault_run.env.update(SIQ_TEST_CONCURRENCY="3", SIQ_TEST_LEASE_TIMEOUT=str(timeout))
    nodes = fault_run.start_workers(3, 4)
    victim = nodes[0]
    task = fault_run.app.tasks["geo.capped"]
    count = 120
    for n in range(count):
        task.delay(n, 0.2)

    def victim_running() -> set[int]:
        finished = {f["n"] for f in fault_run.finishes()}
        return {s["n"] for s in fault_run.starts() if s["node"] == victim.name and s["n"] not in finished}

    store = redis.Redis.from_url(fault_run.env["SIQ_TEST_STORE"])
    leases = "siq:{geo}capped:leases"
    until(lambda: len(fault_run.starts()) >= 6 and victim_running(), 60, "a body running on the victim")
    victim.kill()
    seconds, micros = store.time()
    killed_us = seconds * 1_000_000 + micros
    killed_at = time.time()
    interrupted = victim_running()
    ids = {s["task_id"] for s in fault_run.starts() if s["n"] in interrupted and s["node"] == victim.name}
    back_us = None
    while back_us is None and time.time() < killed_at + timeout + 5:
        seconds, micros = store.time()
        now_us = seconds * 1_000_000 + micros
        dead = [(m, e) for m, e in store.zrange(leases, 0, -1, withscores=True) if m.decode().split(":")[0] in ids]
        if not [m for m, e in dead if e > now_us]:
            back_us = now_us
        time.sleep(0.05)
    finishes = wait_finished(fault_run, count, 120)
    starts = fault_run.starts()
    ends: dict[int, float] = {}
    for f in fault_run.finishes():
        ends.setdefault(f["n"], f["t"])
    killed = [s for s in starts if s["node"] == victim.name and s["n"] in interrupted and s["t"] < killed_at]
    ended = {**ends, **{s["n"]: killed_at for s in killed}}  # a killed body ended with its process
    rest = [s for s in starts if s not in killed]
    most = max(most_in_flight(killed + [s for s in rest if s["t"] < killed_at], ended, killed_at)[0],
               most_in_flight(rest, ends, max(ends.values()))[0])  # fmt: skip
    twice = sorted(n for n, c in Counter(s["n"] for s in starts).items() if c > 1)
    back = (back_us - killed_us) / 1e6 if back_us is not None else float("nan")
    print(f"\nkilled with {sorted(interrupted)} running; their leases came back {back:.2f} s after the kill "
          f"(store clock, lease timeout {timeout:.0f} s); most in flight {most}; started twice: {twice}")  # fmt: skip
    assert interrupted, "the kill hit a running body"
    assert sorted(finishes) == list(range(count)) and max(finishes.values()) == 1, "every task completed once"
    assert set(twice) == interrupted, "an interrupted body runs again, nothing else does"
    assert most <= 3, "never more than 3 bodies at once"
    assert back_us is not None and back <= timeout + 1.0, "the dead bodies' leases came back in time"


def test_a_node_killed_between_taking_a_message_and_holding_it_loses_nothing(fault_run: CeleryRun) -> None:
    """The node SIGKILLs itself having read task 7's message from a BRPOP reply, before
    kombu writes it to the unacked hash (tests/apps/geo.py, ``die_in_transit``): kombu
    alone loses that message (tests/test_broker_transit.py). Its transit record brings it
    back: every task finishes, task 7 once, on the node started after the kill. The kill
    takes the whole process group, so a body that had ended on the victim and not yet
    recorded its finish runs again (acks_late's at-least-once): only such a task may finish
    twice."""
    victim = fault_run.start_worker("victim", 2, env={"SIQ_TEST_DIE_IN_TRANSIT": "7"})
    publish(fault_run, range(30))
    until(lambda: not victim.alive, 60, "the victim to take task 7's message and die")
    killed_at = time.time()
    survivor = fault_run.start_worker("survivor", 2).wait_ready()
    finishes = wait_finished(fault_run, 30, 90)
    seven = [f["t"] for f in fault_run.finishes() if f["n"] == 7]
    before = sum(1 for f in fault_run.finishes() if f["node"] == victim.name)
    print(f"\ntask 7 finished {seven[0] - killed_at:.1f} s after the kill; {before} finished on the victim before")
    assert victim.process is not None and victim.process.returncode == -signal.SIGKILL
    first = {}
    for f in sorted(fault_run.finishes(), key=lambda f: f["t"]):
        first.setdefault(f["n"], f["node"])
    twice = sorted(n for n, c in finishes.items() if c > 1)
    print(f"finished twice (ended on the victim, its finish not recorded): {twice}")
    assert sorted(finishes) == list(range(30)), "every task finished"
    assert max(finishes.values()) <= 2 and all(first[n] == victim.name for n in twice), (
        "only a body that ended on the victim before the kill ran again"
    )
    assert finishes[7] == 1 and len(twice) <= 2, "task 7 once; at most a body per victim process again"
    assert "put back 1 task message" in survivor.log(), "task 7 came back through its transit record"
