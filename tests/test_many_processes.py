"""Many processes, one interval (real processes, real Redis and SQLite, real time).

8 processes x 50 ``with q.slot()`` calls at 10 ms. Asserted: guarantees, not speed
(speed lives in bench/): every call ran exactly once, no two authorized starts closer
than the interval on the store clock, no two bodies closer than 9 ms on the host clock,
and starts in ticket order.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from siq_celery.loadtest import run_slot_processes, summarize
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

# Real processes timed on the host clock of a 2-core shared machine: a rare scheduling
# spike of a few ms can delay one body past the bound. Such a test runs at most three times more
# (same tolerances; a real defect fails three times; pytest -ra lists every rerun).
pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]

PROCESSES, CALLS, INTERVAL_US = 8, 50, 10_000


@pytest.fixture(params=["redis", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"sqlite:///{tmp_path}/siq.db"


def test_eight_processes_share_one_10ms_interval(url: str, capfd: pytest.CaptureFixture[str]) -> None:
    records = run_slot_processes(url, "procs", "10ms", processes=PROCESSES, calls=CALLS)
    assert sorted((r.process, r.call) for r in records) == [(p, c) for p in range(PROCESSES) for c in range(CALLS)]
    # Each ticket once. A process that stood still after its body's report, while a later
    # start came, gives its start up and waits again with a new ticket (client/body.py,
    # logged): seen once on a loaded CI host (ticket 156 given up, 401 taken).
    again = capfd.readouterr().err.count("a later start came: waiting again")
    tickets = {r.ticket for r in records}
    assert len(tickets) == PROCESSES * CALLS
    given_up = set(range(1, PROCESSES * CALLS + again + 1)) - tickets
    assert len(given_up) == again and max(tickets) <= PROCESSES * CALLS + again, (again, sorted(given_up))
    s = summarize(records, INTERVAL_US)
    print(s)
    assert s.store_gaps_below_interval == 0 and s.min_store_gap_ms >= 10.0
    host_gaps_at_least([s.min_body_gap_ms], 9.0, "gap between bodies")
    # In ticket order, but for a ticket whose process stood still past its slot between its
    # claim and its ask: the line does not wait for it (docs/design.md, "The guarantees"),
    # which only this host's scheduling decides (seen once, 1 of 400, beside the untimed part).
    host_clock(s.order_inversions == 0, f"{s.order_inversions} start(s) out of ticket order: a late ask overtaken")


def _release_loop(url: str, out: mp.Queue[list[str]]) -> None:  # runs in a child process
    from siq_celery import IntervalQueue

    q = IntervalQueue("racing", url=url)
    mine: list[str] = []
    while True:
        batch = q.backend.release("racing", 10**12, limit=7)
        if not batch.tasks:
            break
        mine += [t.task_id for t, _ in batch.tasks]
        q.backend.unpark("racing", [t.task_id for t, _ in batch.tasks])
    out.put(mine)


def test_eight_releasers_racing_release_each_parked_task_once(url: str) -> None:

    from siq_celery import IntervalQueue
    from siq_celery.parked import ParkedTask

    q = IntervalQueue("racing", url=url, interval="10ms")
    q.ensure(reset=True)
    tickets = q.claim_many(2000)
    assert q.backend.park("racing", tickets[0].epoch, [ParkedTask(t.number, f"t{t.number}", "{}") for t in tickets])
    out: mp.Queue[list[str]] = mp.Queue()
    procs = [mp.Process(target=_release_loop, args=(url, out)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    released = [task_id for _ in procs for task_id in out.get(timeout=60)]
    for p in procs:
        p.join(10)
    assert sorted(released) == sorted(f"t{n}" for n in range(1, 2001))  # every one, once
    assert q.status().parked == 0
