"""What rate-limited fleets ask for next, under real workers: per-key queues, weighted
tasks, and backing off the whole queue on a 429."""

from __future__ import annotations

import bisect
import itertools
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis

from tests.integration.conftest import CeleryRun, gaps_ms, used_starts
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]


def by_queue(starts: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in starts:
        grouped[s["queue"]].append(s)
    return grouped


def test_a_thousand_per_key_queues_on_two_nodes(celery_run: CeleryRun) -> None:
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms", SIQ_TEST_KEY_IDLE="10")
    celery_run.start_workers(2, 4)
    task = celery_run.app.tasks["geo.per_key"]
    hot = [f"hot-{i}" for i in range(10)]
    calls = [((n,), {"shop": hot[n % 10]}) for n in range(300)]  # 30 calls for each of 10 busy shops
    calls += [((300 + i,), {"shop": f"quiet-{i}"}) for i in range(990)]  # and one for each of 990 more
    calls.sort(key=lambda c: c[0][0] % 7)  # mixed traffic
    published = time.time()
    task.apply_many(calls)
    starts = celery_run.wait_for_count(len(calls), timeout=120)
    took = max(s["t"] for s in starts) - published
    queues = by_queue(starts)
    # the guarantee, on the store's clock: authorized starts of one key never closer than 50 ms
    store_gaps = [
        (b - a) / 1000 for q in queues.values() for a, b in itertools.pairwise(sorted(s["store_start_us"] for s in q))
    ]
    # and what the service sees, bodies on this host's clock: at most 1 in 400 below 0.9 I
    # (the bound the peers bench holds to; a 2-core host under 8 pool processes can
    # deschedule a body for several ms after its authorization)
    body_gaps = [g for q in queues.values() if len(q) > 1 for g in gaps_ms(q)]
    hot_gaps = [g for q in hot for g in gaps_ms(queues[f"shop:{q}"])]
    store = redis.Redis.from_url(celery_run.env["SIQ_TEST_STORE"])
    listed = celery_run.siq("status", "shop:*").strip().splitlines()[1:]
    listed_at_us = int(store.time()[0]) * 1_000_000  # the store's clock, to the second below, after the listing
    # Every key active within its idle expiry (10 s) of the end of the listing was there all
    # through it; on a loaded machine the run (and the command's start-up) can outlast it,
    # and the first quiet keys have then rightly expired.
    alive = {q for q, rows in queues.items() if max(r["store_start_us"] for r in rows) > listed_at_us - 9_000_000}
    print(f"\n{len(queues)} queues, {len(starts)} starts in {took:.1f} s; smallest per-key gap: store "
          f"{min(store_gaps):.2f} ms, bodies {min(body_gaps):.2f} ms ({sum(g < 45.0 for g in body_gaps)} of "
          f"{len(body_gaps)} below 45 ms); busy shops' gaps median {statistics.median(hot_gaps):.1f} ms, "
          f"max {max(hot_gaps):.1f} ms; siq status 'shop:*' listed {len(listed)}, "
          f"of {len(alive)} active within 9 s")  # fmt: skip
    assert len(queues) == 1000 and len(starts) == len(calls)
    assert min(store_gaps) >= 50.0, "each key keeps its own interval"
    below = sum(g < 45.0 for g in body_gaps)
    host_clock(below <= max(1, len(starts) // 400), f"{below} body gaps below 45 ms: more than rare noise")
    median = statistics.median(hot_gaps)  # busy keys run near their interval next to 990 others
    host_clock(median <= 75.0, f"busy keys' median gap {median:.1f} ms > 75 ms")
    assert alive <= {line.split()[0] for line in listed} and len(listed) <= 1000
    time.sleep(11.0)  # idle for longer than siq_key_idle_expiry (10 s)
    left = list(store.scan_iter(match="siq:{shop:*", count=1000))
    print(f"keys of per-key queues left after 11 s idle: {len(left)}")
    assert left == []


def test_a_cost_3_task_keeps_the_next_start_three_intervals_away(celery_run: CeleryRun) -> None:
    celery_run.env.update(SIQ_TEST_INTERVAL="20ms")
    celery_run.start_workers(2, 2)
    task = celery_run.app.tasks["geo.weighted"]
    costs = [3, 1, 1, 3, 1, 2, 1, 3, 3, 1] * 4
    for n, cost in enumerate(costs):
        task.delay(n, cost=cost)
    starts = celery_run.wait_for_count(len(costs))

    def after(clock: str, scale: float) -> list[tuple[int, float]]:
        """(cost of a start, ms to the next start) on one clock."""
        ordered = sorted(starts, key=lambda s: s[clock])
        return [(costs[a["n"]], (b[clock] - a[clock]) * scale) for a, b in itertools.pairwise(ordered)]

    store, bodies = after("store_start_us", 1e-3), after("t", 1e3)
    worst = {c: (min(g for k, g in store if k == c), min(g for k, g in bodies if k == c)) for c in (1, 2, 3)}
    print("\nsmallest gap after a start of cost 1/2/3, store / bodies: "
          + ", ".join(f"{s:.2f} / {b:.2f} ms" for s, b in worst.values()))  # fmt: skip
    # the guarantee, on the store's clock: a start of cost c holds the next one c intervals away
    assert all(gap >= 20.0 * cost for cost, gap in store)
    # and bodies on this host's clock: at most 1 in 400 (here: 1) below 0.9 of that
    below = sum(gap < 0.9 * 20.0 * cost for cost, gap in bodies)
    host_clock(below <= 1, f"{below} body gaps below 0.9 of their cost's spacing")


class FlakyService:
    """A local API: 200, except one 429 with Retry-After (1 s) on the 10th call."""

    def __init__(self, retry_after: int = 1) -> None:
        self.calls: list[tuple[float, int, int]] = []  # (time, n, status)
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                n = int(self.path.split("n=")[1])
                status = 429 if len(service.calls) == 9 else 200
                service.calls.append((time.time(), n, status))
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", str(retry_after))
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def service() -> Iterator[FlakyService]:
    s = FlakyService()
    yield s
    s.server.shutdown()
    s.server.server_close()


def test_a_429_backs_off_every_worker_and_the_call_is_retried_without_using_a_retry(
    celery_run: CeleryRun, service: FlakyService
) -> None:
    celery_run.env.update(SIQ_TEST_INTERVAL="100ms")
    celery_run.start_workers(2, 2)
    task = celery_run.app.tasks["geo.call_api"]  # max_retries=0: a retry would fail it
    for n in range(30):
        task.delay(n, service.url)
    celery_run.wait_for(lambda s: len({f["n"] for f in celery_run.finishes()}) >= 30, 60, "30 calls")
    calls = sorted(service.calls)
    limited = next(i for i, c in enumerate(calls) if c[2] == 429)
    t429, n429, _ = calls[limited]
    pause = calls[limited + 1][0] - t429
    retried = [c for c in calls if c[1] == n429 and c[2] == 200]
    starts = celery_run.starts()
    gaps = [(b[0] - a[0]) * 1000 for a, b in itertools.pairwise(calls)]
    print(f"\n429 on call {limited + 1} (task {n429}); next call {pause:.3f} s later; task {n429} succeeded "
          f"{len(retried)} time(s); {len(calls)} calls; smallest gap {min(gaps):.2f} ms; "
          f"retries used {sorted({s['retries'] for s in starts})}")  # fmt: skip
    # every worker held its starts for Retry-After, and went on right after it
    host_clock(0.99 <= pause < 1.5, f"the next call came {pause:.3f} s after the 429 (Retry-After: 1)")
    assert len(retried) == 1 and sum(1 for c in calls if c[2] == 200) == 30, "the failed call ran again, once"
    assert {s["retries"] for s in starts} == {0}, "the back-off used no retry"
    host_gaps_at_least(gaps, 90.0)
    assert calls[limited + 1][1] == n429, "the backed-off task kept its place: first after the hold"


def test_a_two_hour_back_off_waits_parked_in_the_store_and_the_line_keeps_its_order(celery_run: CeleryRun) -> None:
    """A 429 with Retry-After: 7200. With a 3 s horizon, the task that backed off and the
    line behind it wait parked in the store, none held by a worker. Two hours later (the
    queue's state moved back by the hold: real workers run on the store's real clock)
    every call runs once, the backed-off one first."""
    service = FlakyService(retry_after=7200)
    try:
        celery_run.env.update(SIQ_TEST_INTERVAL="100ms", SIQ_TEST_HORIZON="3", SIQ_TEST_RELEASE_EVERY="0.5")
        celery_run.start_workers(2, 2)
        task = celery_run.app.tasks["geo.call_api"]
        queue = task.siq_queue()
        queue.ensure(0.1, reset=True)
        for n in range(30):
            task.delay(n, service.url)
        deadline = time.monotonic() + 30
        while queue.status().parked < 21:  # the one that backed off, and the 20 behind it
            assert time.monotonic() < deadline, f"{queue.status().parked} parked"
            time.sleep(0.1)
        held, rss = celery_run.held_by_workers()
        logs = "".join(w.log() for w in celery_run.workers)
        print(f"\n2 h back-off: {queue.status().parked} parked, {held} held by workers ({rss:.1f} MB)")
        assert held == 0 and len(service.calls) == 10
        assert "parked until the hold ends" in logs, logs[-3000:]
        state = queue.backend.keys("geo").state
        store = redis.Redis.from_url(celery_run.env["SIQ_TEST_STORE"])
        # Two hours pass, but for 2 s from now: counted from the store's clock now, not from
        # the back-off (parking the line behind it takes 2 s itself: a hold already over
        # when its tasks come back lets them race for the first slot).
        seconds, micros = store.time()
        hold_ends = int(store.hget(state, "last_start_us")) + 100_000
        early = hold_ends - (seconds * 1_000_000 + micros + 2_000_000)
        with store.pipeline(transaction=True) as moves:
            for field in ("last_start_us", "anchor_us"):
                moves.hincrby(state, field, -early)
            moves.execute()
        celery_run.wait_for(lambda s: len({f["n"] for f in celery_run.finishes()}) >= 30, 60, "30 calls")
    finally:
        service.server.shutdown()
        service.server.server_close()
    calls = sorted(service.calls)
    ok = [c for c in calls if c[2] == 200]
    assert len(ok) == 30 and len({c[1] for c in ok}) == 30, "every call once"
    assert calls[10][1] == calls[9][1], f"the backed-off call first after the hold: {calls[8:13]}"
    host_gaps_at_least([(b[0] - a[0]) * 1000 for a, b in itertools.pairwise(calls[10:])], 90.0, "gap between calls")
    assert queue.status().parked == 0


def test_two_limits_on_one_task_are_never_exceeded_and_a_paused_one_holds_no_slot(celery_run: CeleryRun) -> None:
    """100 ms and "10 per 2 s" on one task (its starts 200 ms apart at least, and never
    more than 10 in any 2 s), with a task limited by the 100 ms queue alone beside it.
    While the 2 s queue is paused, the two-limit tasks wait and the other one goes on at
    its own 100 ms: no slot of the shared queue is held for the paused one."""
    celery_run.start_workers(2, 2)
    both, alone = celery_run.app.tasks["geo.two_limits"], celery_run.app.tasks["geo.one_limit"]
    for n in range(30):
        both.delay(n)
    celery_run.wait_for(lambda s: len(s) >= 8, 30, "8 starts")
    celery_run.siq("pause", "{geo}per-2s")
    paused_at = time.time()
    for n in range(100, 120):
        alone.delay(n)
    time.sleep(3.0)
    resumed_at = time.time()
    celery_run.siq("resume", "{geo}per-2s")
    starts = celery_run.wait_for_count(50, timeout=90)
    limited = sorted((s for s in starts if s["n"] < 100), key=lambda s: s["t"])
    single = sorted((s for s in starts if s["n"] >= 100), key=lambda s: s["t"])
    during = [s for s in limited if paused_at + 0.05 < s["t"] < resumed_at]
    authorized = [s["store_start_us"] for s in limited]  # the store's own record of each start
    window = max(sum(1 for t in authorized if a <= t < a + 2_000_000) for a in authorized)
    shared = sorted(starts, key=lambda s: s["t"])
    alone_during = [s for s in single if paused_at < s["t"] < resumed_at]
    print(f"\n{len(limited)} two-limit starts, smallest gap {min(gaps_ms(limited)):.2f} ms, at most {window} in 2 s; "
          f"{len(during)} while paused; {len(alone_during)} single-limit starts meanwhile, smallest gap "
          f"{min(gaps_ms(single)):.2f} ms; smallest gap in the shared 100 ms queue "
          f"{min(gaps_ms(shared)):.2f} ms")  # fmt: skip
    assert sorted(s["n"] for s in starts) == [*range(30), *range(100, 120)]
    assert window <= 10, "the 10-per-2-s limit held (store clock)"
    host_gaps_at_least(gaps_ms(limited), 0.9 * 200)  # and 200 ms between two-limit starts
    host_gaps_at_least(gaps_ms(shared), 0.9 * 100)  # the 100 ms limit held for both tasks together
    assert during == [], "nothing started in a paused limit"
    assert len(alone_during) >= 15, "the other queue kept its own pace: no slot held for the paused one"


def test_a_window_quota_with_spacing_on_three_nodes(celery_run: CeleryRun) -> None:
    """The limits page's "10 a second and 10,000 a day", scaled: 50 ms spacing and at most 50
    starts in any 10 s window; 120 tasks published at once on 3 nodes x -c 2."""
    celery_run.start_workers(3, 2)
    task = celery_run.app.tasks["geo.windowed"]
    published = time.time()
    for n in range(120):
        task.delay(n)
    starts = celery_run.wait_for_count(120, timeout=90)
    store = sorted(s["store_start_us"] for s in starts)
    window, spacing = 10_000_000, 50_000
    most = max(bisect.bisect_left(store, t + window) - i for i, t in enumerate(store))  # any [t, t + 10 s)
    bodies = sorted(s["t"] for s in starts)
    most_bodies = max(bisect.bisect_left(bodies, t + 10.0) - i for i, t in enumerate(bodies))
    # Bodies start after their authorization by a varying delay (the reply, the process):
    # measured as the spacing is, within 0.1 x 50 ms (a window of 10 s less 5 ms).
    most_bodies_tol = max(bisect.bisect_left(bodies, t + 9.995) - i for i, t in enumerate(bodies))
    least_span = min(b - a for a, b in zip(bodies, bodies[50:], strict=False)) * 1000
    store_gaps = [(b - a) / 1000 for a, b in itertools.pairwise(store)]
    body_gaps = [(b - a) * 1000 for a, b in itertools.pairwise(bodies)]
    first, second, third = store[:50], store[50:100], store[100:]
    rel = [(t - store[0]) / 1e6 for t in (first[-1], second[0], second[-1], third[0], third[-1])]
    deferrals = len({s["task_id"] for s in starts}) - len(starts)
    print(f"\n120 tasks, published {store[0] / 1e6 - published:.2f} s before the first start; store clock, from the "
          f"first start: 50th at {rel[0]:.2f} s, 51st at {rel[1]:.2f} s, 100th at {rel[2]:.2f} s, 101st at "
          f"{rel[3]:.2f} s, last at {rel[4]:.2f} s; most starts in any 10 s window: store {most}, bodies "
          f"{most_bodies} (in 10 s less 5 ms: {most_bodies_tol}; body k to k + 50 at least {least_span:.2f} ms); "
          f"smallest gap: store {min(store_gaps):.2f} ms, bodies {min(body_gaps):.2f} ms; "
          f"median gap in the first 50: {statistics.median(store_gaps[:49]):.1f} ms")  # fmt: skip
    assert len(starts) == 120 and len({s["n"] for s in starts}) == 120 and deferrals == 0, "every task runs once"
    assert most <= 50, "no 10 s window on the store's clock holds more than 50 starts"
    assert min(store_gaps) >= 50.0, "and none closer than 50 ms"
    assert second[0] - first[0] >= window and third[0] - second[0] >= window  # the rest as the window frees
    assert second[0] - first[0] <= window + 1_000_000, "the 51st starts as the first leaves the window"
    host_clock(statistics.median(store_gaps[:49]) <= 1.3 * spacing / 1000, "the first 50 run near 50 ms apart")
    host_clock(min(body_gaps) >= 0.9 * spacing / 1000, f"bodies {min(body_gaps):.2f} ms apart: below 0.9 x 50 ms")
    host_clock(most_bodies_tol <= 50, f"{most_bodies_tol} bodies in a window of 10 s less 5 ms")


def most_in_flight(starts: list[dict[str, Any]], ends: dict[int, float], until: float) -> tuple[int, list[float]]:
    """The most bodies running at once, as the bodies count it (each from its start to its
    own end, or ``until`` if it never ended: its process died), and when the count changed."""
    events = sorted(
        [(s["t"], 1) for s in starts] + [(ends.get(s["n"], until), -1) for s in starts], key=lambda e: (e[0], e[1])
    )  # an end before a start at the same instant
    running, most, full_at = 0, 0, []
    for t, step in events:
        running += step
        most = max(most, running)
        if running == 3 and step == 1:
            full_at.append(t)
    return most, full_at


def test_a_concurrency_cap_of_three_on_three_nodes(celery_run: CeleryRun) -> None:
    """Acceptance 2, scaled: concurrency 3 on 3 nodes x -c 4, 200 ms bodies: in flight never
    above 3 (exact), every lease given back, and the throughput near 3 / 0.2 s. The rate is
    host timing: a quiet run measured 96.2 %, a loaded one 92-95 %; the suite asserts 85 %
    (a rerunnable host-clock check) so that only a real loss of rate fails it."""
    celery_run.start_workers(3, 4)
    task = celery_run.app.tasks["geo.capped"]
    count, work = 150, 0.2
    for n in range(count):
        task.delay(n, work)
    starts = celery_run.wait_for_count(count, timeout=120)
    deadline = time.monotonic() + 10
    while len(celery_run.finishes()) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    ends = {f["n"]: f["t"] for f in celery_run.finishes()}
    most, _ = most_in_flight(starts, ends, max(ends.values()))
    span = max(ends.values()) - min(s["t"] for s in starts)
    rate, cap_rate = count / span, 3 / work
    status = celery_run.siq("status", "{geo}capped")
    handoffs = sorted(  # from the latest body end to each start: the lease's way to the next body
        (s["t"] - max(e for e in ends.values() if e <= s["t"])) * 1000
        for s in starts
        if any(e <= s["t"] for e in ends.values())
    )
    print(f"\n{count} bodies of {work * 1000:.0f} ms on 3 nodes x -c 4, cap 3: most in flight {most}; "
          f"{span:.2f} s from the first start to the last end: {rate:.2f}/s = {100 * rate / cap_rate:.1f} % of "
          f"{cap_rate:.0f}/s; from a body's end to the next start: median {statistics.median(handoffs):.1f} ms, "
          f"90th percentile {handoffs[len(handoffs) * 9 // 10]:.1f} ms; nodes "
          f"{sorted(Counter(s['node'] for s in starts).items())}\n{status}")  # fmt: skip
    assert len(starts) == count and len(ends) == count, "every task runs once"
    assert most <= 3, "never more than 3 bodies at once"
    host_clock(rate >= 0.85 * cap_rate, f"throughput {rate:.2f}/s below 85 % of {cap_rate:.0f}/s")
    assert " 0/3 " in status, "every lease given back"


def test_a_margin_spaces_two_nodes_starts_by_the_interval_and_the_margin(celery_run: CeleryRun) -> None:
    """40 ms and a margin of 10 ms (``siq_default_margin``) on 2 nodes x -c 2: the ledger's
    authorizations and the bodies' reports are exactly 50 ms apart or more, the bodies
    themselves too (host clock), and the line runs at one start per 50 ms."""
    from siq_celery import IntervalQueue

    celery_run.env.update(SIQ_TEST_INTERVAL="40ms", SIQ_TEST_LIMIT_MARGIN="10ms")
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    for n in range(40):
        record.delay(n)
    starts = celery_run.wait_for_count(40)
    queue = IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"])
    state = queue.status().state
    assert (state.interval_us, state.declared_interval_us, state.margin_us) == (50_000, 40_000, 10_000)
    ledger = sorted(used_starts(queue.ledger()), key=lambda r: r.start_us)
    assert len(ledger) == 40 and all(r.interval_us == 50_000 for r in ledger)
    assert min(b.start_us - a.start_us for a, b in itertools.pairwise(ledger)) >= 50_000
    began = sorted(r.began_us for r in ledger if r.began_us is not None)
    assert len(began) == 40 and min(b - a for a, b in itertools.pairwise(began)) >= 50_000
    host_gaps_at_least(gaps_ms(starts), 45.0)
    span = max(s["t"] for s in starts) - min(s["t"] for s in starts)
    print(f"40 starts in {span:.3f} s: {span / 39 * 1000:.2f} ms a start at 40 ms + 10 ms")
    host_clock(span <= 1.1 * 39 * 0.05, f"40 starts took {span:.3f} s (bound {1.1 * 39 * 0.05:.3f} s)")
