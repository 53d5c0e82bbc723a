"""The state store fails under running workers: lost, unreachable, corrupt, shared.

Every test runs real ``celery worker`` processes at 50 ms and checks the order of
guarantees: the rate cap first (no gap below 0.9 x the interval), nothing lost second
(every task finishes, once), and a log that says what happened.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import redis

from siq_celery import IntervalQueue
from tests.faults.conftest import ControlledRedis, publish, wait_finished
from tests.integration.conftest import CeleryRun, gaps_ms, inversions
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults, HOST_CLOCK_RERUNS]

INTERVAL_MS = 50.0
CAP_MS = 0.9 * INTERVAL_MS


def epoch_of(store: ControlledRedis) -> str:
    return IntervalQueue("geo", url=store.url(0)).status().state.epoch


def test_store_restarted_without_persistence_starts_a_new_epoch_without_a_burst(
    fault_run: CeleryRun, store: ControlledRedis
) -> None:
    fault_run.start_workers(2, 2)
    publish(fault_run, range(120))
    fault_run.wait_for(lambda s: len(s) >= 40, 30, "40 starts")
    before = epoch_of(store)
    store.crash()  # every ticket, the last start and the finished records are gone
    lost_at = time.time()
    store.start()
    finishes = wait_finished(fault_run, 120, 60)
    starts = fault_run.starts()
    after = [s for s in starts if s["t"] > lost_at]
    gaps = gaps_ms(starts)
    print(f"\n{len(starts)} starts, {len(after)} after the loss; smallest gap {min(gaps):.2f} ms; "
          f"epoch {before} -> {epoch_of(store)}")  # fmt: skip
    assert sorted(finishes) == list(range(120)) and max(finishes.values()) == 1, "every task ran, once"
    host_gaps_at_least(gaps, CAP_MS)  # no burst: the new state waits an interval before its first start
    assert epoch_of(store) != before
    assert after and min(s["ticket"] for s in after) == 1, "the tasks re-claimed tickets in the new epoch"
    assert any("from another epoch" in w.log() or "claiming anew" in w.log() for w in fault_run.workers)


@pytest.mark.parametrize("how", ["refused", "hung"])
def test_store_unreachable_for_10s_starts_nothing_loses_nothing_and_says_why(
    fault_run: CeleryRun, store: ControlledRedis, how: str
) -> None:
    """``refused``: the server is down (connections refused), then back with its data.
    ``hung``: the server is frozen (SIGSTOP), so requests hang until the client's timeout."""
    fault_run.start_workers(2, 2)
    publish(fault_run, range(100))
    fault_run.wait_for(lambda s: len(s) >= 30, 30, "30 starts")
    during = threading.Thread(target=publish, args=(fault_run, range(100, 120)))
    if how == "refused":
        store.shutdown_saving()
    else:
        store.freeze()
    down_at = time.time()
    if how == "refused":  # published while the store is down: without a ticket, not lost
        during.start()
    time.sleep(10.0)
    if how == "refused":
        during.join()
        store.start()
    else:
        store.thaw()
    up_at = time.time()
    total = 120 if how == "refused" else 100
    finishes = wait_finished(fault_run, total, 90)
    starts = fault_run.starts()
    # A start authorized just before the outage records its body a moment later.
    in_outage = [s for s in starts if down_at + 0.05 < s["t"] < up_at]
    warned = sum(w.log().count("state store unreachable, nothing starts") for w in fault_run.workers)
    gaps = gaps_ms(starts)
    print(f"\n{how}: {len(in_outage)} starts in the {up_at - down_at:.1f} s outage, {warned} warnings, "
          f"{len(starts)} starts, smallest gap {min(gaps):.2f} ms, inversions {inversions(starts)}")  # fmt: skip
    assert in_outage == [], "nothing starts without the store"
    assert sorted(finishes) == list(range(total)) and max(finishes.values()) == 1, "nothing lost, nothing twice"
    assert warned >= 2, "the worker logs say why nothing starts"
    host_gaps_at_least(gaps, CAP_MS)


def test_corrupt_state_stops_starts_with_a_clear_error_until_reset(
    fault_run: CeleryRun, store: ControlledRedis
) -> None:
    fault_run.start_workers(1, 2)
    publish(fault_run, range(10))
    fault_run.wait_for_count(10, timeout=30)
    state_key = "siq:{geo}:state"
    redis.Redis.from_url(store.url(0)).hset(state_key, "last_start_us", "garbage")
    corrupted_at = time.time()
    publish(fault_run, range(10, 20))  # published without a ticket: the producer logs why
    time.sleep(5.0)
    assert [s for s in fault_run.starts() if s["t"] > corrupted_at] == [], "nothing starts from corrupt state"
    worker = fault_run.workers[0]
    log = worker.log()
    assert f"field 'last_start_us' of '{state_key}' holds 'garbage'" in log and "siq reset geo --interval" in log
    assert worker.alive, "no crash, no restart loop"
    errors = log.count("holds 'garbage'")
    fault_run.siq("reset", "geo", "--interval", "50ms", "--yes")
    finishes = wait_finished(fault_run, 20, 60)
    print(f"\n{errors} error lines in 5 s while corrupt; then reset: {len(finishes)} finished")
    assert sorted(finishes) == list(range(20)) and max(finishes.values()) == 1
    assert errors <= 20, "the worker backs off instead of spinning"
    assert min(gaps_ms(fault_run.starts())) >= CAP_MS


def test_two_apps_with_different_key_prefixes_never_see_each_other(
    fault_run: CeleryRun, store: ControlledRedis, records: ControlledRedis
) -> None:
    """Same Redis, same queue name "geo", different ``siq_key_prefix`` and intervals: two
    independent queues (their starts interleave closer than either interval)."""
    env = fault_run.env
    other = CeleryRun(
        {**env, "SIQ_TEST_KEY_PREFIX": "other", "SIQ_TEST_INTERVAL": "70ms",
         "SIQ_TEST_QUEUE": env["SIQ_TEST_QUEUE"] + "-o", "SIQ_TEST_RECORD": records.url(1)},
        fault_run.logdir / "other",
    )  # fmt: skip
    try:
        fault_run.start_workers(1, 2)
        other.start_workers(1, 2)
        publish(fault_run, range(40))
        publish(other, range(30))
        mine = fault_run.wait_for_count(40)
        theirs = other.wait_for_count(30)
    finally:
        other.close()
    keys = sorted(k.decode() for k in redis.Redis.from_url(store.url(0)).scan_iter(count=1000))
    combined = gaps_ms(mine + theirs)
    print(f"\nkeys {keys}; smallest gap {min(gaps_ms(mine)):.2f} ms (siq, 50 ms) "
          f"{min(gaps_ms(theirs)):.2f} ms (other, 70 ms), {min(combined):.2f} ms combined")  # fmt: skip
    assert {k.split(":")[0] for k in keys} == {"siq", "other"}
    assert IntervalQueue("geo", url=store.url(0)).status().state.interval_us == 50_000
    assert IntervalQueue("geo", url=store.url(0), key_prefix="other").status().state.interval_us == 70_000
    assert "geo" in fault_run.siq("status") and "70ms" not in fault_run.siq("status")
    host_gaps_at_least(gaps_ms(mine), CAP_MS)
    host_gaps_at_least(gaps_ms(theirs), 0.9 * 70)
    assert min(combined) < CAP_MS, "the two queues did not wait for each other"


def test_a_worker_started_while_the_store_is_down_announces_as_soon_as_it_is_back(
    fault_run: CeleryRun, store: ControlledRedis
) -> None:
    """The deploy's interval applies before the first task even when the store was down at
    the worker's start: the announcement is retried at once (not at the first renewal,
    10 s later), and the node's tasks wait for it instead of running at the old interval."""
    IntervalQueue("geo", url=store.url(0), interval="5ms").declare(origin="the old code")
    store.shutdown_saving()
    fault_run.env["SIQ_TEST_INTERVAL"] = "100ms"  # the new code, publisher included
    worker = fault_run.start_worker("new")
    worker.wait_ready()
    store.start()  # with its data: the stored interval is still 5 ms
    back = time.time()
    publish(fault_run, range(20))
    starts = fault_run.wait_for(lambda s: len(s) >= 20, 60, "20 starts")
    times = sorted(s["store_start_us"] for s in starts)
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(times)]
    log = worker.log()
    print(f"\nfirst start {times[0] / 1e6 - back:.2f}s after the store came back; store gaps {min(gaps):.3f}-"
          f"{max(gaps):.3f} ms")  # fmt: skip
    assert min(gaps) >= 100.0, "tasks ran at the interval stored before the announcement"
    assert "could not announce this worker's interval declarations, the state store is unreachable" in log
    assert "queue 'geo': declared interval 5ms -> 100ms by new@siq-test" in log


def test_a_finish_the_store_missed_is_recorded_when_it_is_back(fault_run: CeleryRun, store: ControlledRedis) -> None:
    """Bodies end while the store is down: their finishes cannot be recorded. Each is tried
    again from its worker process, its lease renewed meanwhile, until the store is back (a
    redelivered copy then finds the task finished: tests/test_task_unit.py)."""
    fault_run.env.update(SIQ_TEST_INTERVAL="100ms", SIQ_TEST_LEASE_TIMEOUT="6")
    for name in ("a", "b"):
        fault_run.start_worker(name, 2).wait_ready()
    publish(fault_run, range(2), work=1.5)
    fault_run.wait_for(lambda s: len(s) >= 2, 30, "both bodies running")
    time.sleep(0.3)
    store.shutdown_saving()  # the bodies end while it is down
    time.sleep(3.5)
    store.start()  # with its data: the starts and leases it had
    finishes = wait_finished(fault_run, 2, 30)
    deadline = time.monotonic() + 10
    while IntervalQueue("geo", url=store.url(0)).status().finished < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    status = IntervalQueue("geo", url=store.url(0)).status()
    logs = "".join(w.log() for w in fault_run.workers)
    print(f"\nstore down 3.5 s as 2 bodies ended: {logs.count('recorded after all')} finishes recorded after all; "
          f"the store knows {status.finished} finished")  # fmt: skip
    assert logs.count("recorded after all") == 2 and status.finished == 2
    assert sorted(finishes) == [0, 1] and max(finishes.values()) == 1
    assert sorted(s["n"] for s in fault_run.starts()) == [0, 1]


def read_only_for(store: ControlledRedis, seconds: float) -> tuple[float, float]:
    """Make ``store`` answer READONLY to every write for ``seconds``, its data kept: a copy
    (another redis-server, synced as its replica, then promoted while the store's writes
    are paused) becomes its master, as a managed failover leaves a ``redis://`` URL behind
    a DNS name pointing at the old master, now a replica; then it is a master again. When
    it began and ended (wall clock)."""
    client = redis.Redis(port=store.port)
    with ControlledRedis() as copy:
        other = redis.Redis(port=copy.port)
        other.execute_command("REPLICAOF", "127.0.0.1", str(store.port))
        client.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        deadline = time.monotonic() + 3
        while True:
            info = other.info("replication")
            if info.get("master_link_status") == "up" and info.get("slave_repl_offset") == client.info(
                "replication"
            ).get("master_repl_offset"):
                break
            assert time.monotonic() < deadline, "the copy did not catch up"
            time.sleep(0.01)
        other.execute_command("REPLICAOF", "NO", "ONE")
        client.execute_command("REPLICAOF", "127.0.0.1", str(copy.port))
        began = time.time()
        client.execute_command("CLIENT", "UNPAUSE")
        time.sleep(seconds)
        client.execute_command("REPLICAOF", "NO", "ONE")
        return began, time.time()


def test_a_store_that_answers_readonly_for_5s_starts_nothing_and_fails_nothing(
    fault_run: CeleryRun, store: ControlledRedis
) -> None:
    fault_run.start_workers(2, 2)
    publish(fault_run, range(150))
    fault_run.wait_for(lambda s: len(s) >= 40, 30, "40 starts")
    during = threading.Thread(target=publish, args=(fault_run, range(150, 200)))  # without a ticket: not lost
    threading.Timer(1.0, during.start).start()
    began, ended = read_only_for(store, 5.0)
    during.join()
    finishes = wait_finished(fault_run, 200, 120)
    starts = fault_run.starts()
    in_outage = [s for s in starts if began + 0.05 < s["t"] < ended]  # a body records its start a moment late
    failed = sum(w.log().count("raised unexpected") for w in fault_run.workers)
    warned = sum(w.log().count("READONLY") for w in fault_run.workers)
    print(f"\nREADONLY for {ended - began:.1f} s: {len(in_outage)} starts meanwhile, {warned} log lines name it, "
          f"{failed} failures; {len(finishes)} tasks finished, most runs of one {max(finishes.values())}")  # fmt: skip
    assert failed == 0, "no task failed"
    assert sorted(finishes) == list(range(200)) and max(finishes.values()) == 1, "every task ran, once"
    assert in_outage == [], "nothing starts on a store that refuses writes"
    assert warned >= 1, "the worker logs say why nothing starts"
    host_gaps_at_least(gaps_ms(starts), CAP_MS)
