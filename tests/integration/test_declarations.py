"""A deploy that changes ``interval=`` takes effect (tasks/declarations.py), with real workers:
the code's declaration against a stored interval, an operator's override across
restarts, and a rolling deploy with old and new code side by side.

Spacing is asserted on the store's clock (exact: the authorized starts) and between
task bodies on the host clock (at least 0.9 x the interval)."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import pytest

from siq_celery.backends import Backend, backend_from_url
from tests.apps.geo import make_app
from tests.integration.conftest import CeleryRun, gaps_ms
from tests.integration.test_limits import most_in_flight

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def store_gaps_ms(starts: list[dict[str, Any]]) -> list[float]:
    times = sorted(s["store_start_us"] for s in starts)
    return [(b - a) / 1000 for a, b in itertools.pairwise(times)]


def publish(run: CeleryRun, numbers: range) -> None:
    task = run.app.tasks["geo.record"]
    for n in numbers:
        task.delay(n)


def run_batch(run: CeleryRun, numbers: range, timeout: float = 60) -> list[dict[str, Any]]:
    """Publish ``numbers`` and return the starts of exactly those tasks."""
    publish(run, numbers)
    wanted = set(numbers)
    starts = run.wait_for(lambda s: wanted <= {r["n"] for r in s}, timeout, f"tasks {numbers}")
    return [s for s in starts if s["n"] in wanted]


def redeploy(run: CeleryRun, interval: str) -> None:
    """New code for the publisher too: it builds its app with the new ``interval=``."""
    run.env["SIQ_TEST_INTERVAL"] = interval
    if run._app is not None:
        run._app.close()
    run._app = make_app(run.env)


def test_a_deploy_that_slows_the_interval_holds_at_once_and_the_log_says_so(celery_run: CeleryRun) -> None:
    redeploy(celery_run, "5ms")
    old = celery_run.start_workers(2, 2)
    fast = run_batch(celery_run, range(40))
    assert statistics.median(store_gaps_ms(fast)) < 20  # the fleet ran at 5 ms
    old[0].kill()  # one dies (its declaration lingers until its TTL), one stops cleanly
    old[1].stop()
    redeploy(celery_run, "100ms")
    new = [celery_run.start_worker(f"new{i}") for i in range(2)]
    for w in new:
        w.wait_ready()
    slow = run_batch(celery_run, range(100, 130))
    body, store = gaps_ms(slow), store_gaps_ms(slow)
    logs = "".join(w.log() for w in new)
    print(f"after the deploy: body gaps {min(body):.2f}-{max(body):.2f} ms, store gaps from {min(store):.3f} ms")
    assert min(store) >= 100.0 and min(body) >= 90.0
    assert "queue 'geo': declared interval 5ms -> 100ms by new" in logs
    assert "effective 5ms -> 100ms" in logs
    status = celery_run.siq("status", "geo")
    row = status.splitlines()[1]
    # the killed node's declaration is still live (until its TTL), and slower ones win
    assert row.split()[1:3] == ["100ms", "100ms"] and "(live: 5ms)" in row, status


def test_an_override_survives_a_restart_clears_and_a_new_deploy_replaces_it(celery_run: CeleryRun) -> None:
    redeploy(celery_run, "100ms")
    worker = celery_run.start_worker("w")
    worker.wait_ready()
    assert "200ms (override)" in celery_run.siq("set-interval", "geo", "200ms")
    worker.stop()
    worker = celery_run.start_worker("w")  # the same code: the override holds
    worker.wait_ready()
    held = store_gaps_ms(run_batch(celery_run, range(10)))
    assert "replaces the override" not in worker.run_log()
    status = celery_run.siq("status", "geo")
    assert "200ms by " in status and status.splitlines()[1].split()[1:3] == ["200ms", "100ms"], status
    celery_run.siq("set-interval", "geo", "--clear")
    cleared = store_gaps_ms(run_batch(celery_run, range(100, 115)))
    celery_run.siq("set-interval", "geo", "200ms")
    worker.stop()
    redeploy(celery_run, "50ms")  # a deploy that changes the declaration
    worker = celery_run.start_worker("w")
    worker.wait_ready()
    deployed = store_gaps_ms(run_batch(celery_run, range(200, 225)))
    print(f"override: {min(held):.3f}-{max(held):.3f} ms; cleared: {min(cleared):.3f}, median "
          f"{statistics.median(cleared):.3f} ms; deployed: {min(deployed):.3f}, median "
          f"{statistics.median(deployed):.3f} ms")  # fmt: skip
    assert min(held) >= 200.0
    assert min(cleared) >= 100.0 and statistics.median(cleared) < 180.0  # back to the declared 100 ms
    assert min(deployed) >= 50.0 and statistics.median(deployed) < 90.0  # the new declaration holds
    assert "declared interval 100ms -> 50ms" in worker.run_log()
    assert "replaces the override 200ms set by " in worker.run_log()


def test_a_rolling_deploy_never_runs_faster_than_the_old_code_until_it_stops(celery_run: CeleryRun) -> None:
    old = celery_run.start_worker("old", env={"SIQ_TEST_INTERVAL": "100ms"})
    old.wait_ready()
    new = celery_run.start_worker("new", env={"SIQ_TEST_INTERVAL": "50ms"})
    new.wait_ready()
    redeploy(celery_run, "50ms")  # the publisher is new code already
    side_by_side = run_batch(celery_run, range(30))
    nodes = {s["node"] for s in side_by_side}
    old.stop()  # its declaration is withdrawn as it stops
    after = run_batch(celery_run, range(100, 140))
    both, alone = store_gaps_ms(side_by_side), store_gaps_ms(after)
    print(f"side by side on {sorted(nodes)}: store gaps from {min(both):.3f} ms, body gaps from "
          f"{min(gaps_ms(side_by_side)):.2f} ms; after the old node stopped: from {min(alone):.3f} ms, median "
          f"{statistics.median(alone):.3f} ms")  # fmt: skip
    assert len(nodes) == 2  # both ran tasks
    assert min(both) >= 100.0 and min(gaps_ms(side_by_side)) >= 90.0
    assert min(alone) >= 50.0 and statistics.median(alone) < 90.0
    assert "effective stays 100ms" in new.log()
    # a script with the same code: nothing to change; with a slower one: it takes effect
    assert "queue 'geo': interval 50ms as declared" in celery_run.siq("sync")
    redeploy(celery_run, "80ms")
    synced = celery_run.siq("sync")
    assert "queue 'geo': declared interval 50ms -> 80ms by siq sync; effective stays 50ms" in synced, synced


def live_nodes(backend: Backend) -> dict[str, int]:
    """The live node declarations of 'geo': node -> expiry, on the store's clock."""
    status = backend.status("geo")
    assert status is not None
    return {n.node: n.expires_us for n in status.sources.live(status.now_us)}


def test_renewals_keep_a_slower_node_live_past_its_ttl_and_killed_it_stops_counting_at_its_ttl(
    celery_run: CeleryRun,
) -> None:
    """Short TTLs: the old node (100 ms) declares for 2 s and renews every 0.67 s; the new
    node (50 ms) declares for 60 s, so it does not declare again during the test: only the
    renewals keep the old node live, and only the expiry ends its hold once it is killed."""
    celery_run.env["SIQ_TEST_RELEASE_EVERY"] = "0.2"
    old = celery_run.start_worker("old", env={"SIQ_TEST_INTERVAL": "100ms", "SIQ_TEST_DECL_TTL": "2"})
    new = celery_run.start_worker("new", env={"SIQ_TEST_INTERVAL": "50ms", "SIQ_TEST_DECL_TTL": "60"})
    old.wait_ready()
    new.wait_ready()
    redeploy(celery_run, "50ms")
    backend = backend_from_url(celery_run.env["SIQ_TEST_STORE"])
    first = live_nodes(backend)["old@siq-test"]
    time.sleep(6.0)  # three of the old node's TTLs
    renewed = live_nodes(backend)
    assert sorted(renewed) == ["new@siq-test", "old@siq-test"] and renewed["old@siq-test"] >= first + 3_000_000
    held = store_gaps_ms(run_batch(celery_run, range(10)))
    old.kill()  # SIGKILL: no withdrawal
    expires = live_nodes(backend)["old@siq-test"]
    while backend.now_us() < expires:
        time.sleep(0.01)
    at_expiry = backend.status("geo")
    after = store_gaps_ms(run_batch(celery_run, range(100, 120)))
    print(f"old node renewed for {(renewed['old@siq-test'] - first) / 1e6:.1f}s past its first expiry; while live: "
          f"store gaps {min(held):.3f}-{max(held):.3f} ms; after its TTL: {min(after):.3f}-{max(after):.3f} ms, "
          f"median {statistics.median(after):.3f} ms")  # fmt: skip
    assert min(held) >= 100.0
    assert at_expiry is not None and at_expiry.state.interval_us == 50_000, "the killed node's declaration held"
    assert min(after) >= 50.0 and statistics.median(after) < 75.0  # a gap above 50 ms: a late body, not the limit
    assert live_nodes(backend).keys() == {"new@siq-test"}


def capped_batch(run: CeleryRun, numbers: range, work: float) -> int:
    """Run ``numbers`` through geo.capped; the most bodies at once, as the bodies count it."""
    task = run.app.tasks["geo.capped"]
    for n in numbers:
        task.delay(n, work)
    wanted = set(numbers)
    starts = run.wait_for(lambda s: wanted <= {r["n"] for r in s}, 60, f"tasks {numbers}")
    starts = [s for s in starts if s["n"] in wanted]
    deadline = time.monotonic() + 10
    while not wanted <= {f["n"] for f in run.finishes()} and time.monotonic() < deadline:
        time.sleep(0.05)
    ends = {f["n"]: f["t"] for f in run.finishes() if f["n"] in wanted}
    assert len(starts) == len(wanted) and len(ends) == len(wanted), "every task runs once"
    return most_in_flight(starts, ends, max(ends.values()))[0]


def test_a_rolling_deploy_of_a_concurrency_cap_holds_the_smaller_cap_until_the_old_node_stops(
    celery_run: CeleryRun,
) -> None:
    """The limits follow the interval's deploy rules with real workers: old code caps the
    queue at 1, new code at 3; side by side the stricter cap holds, as the bodies count it,
    and when the old node stops (withdrawing its declaration) the new cap holds."""
    old = celery_run.start_worker("old", env={"SIQ_TEST_CONCURRENCY": "1"})
    new = celery_run.start_worker("new", 4, env={"SIQ_TEST_CONCURRENCY": "3"})
    old.wait_ready()
    new.wait_ready()
    both = capped_batch(celery_run, range(12), 0.1)
    during = celery_run.siq("status", "{geo}capped")
    old.stop()
    alone = capped_batch(celery_run, range(100, 130), 0.1)
    after = celery_run.siq("status", "{geo}capped")
    print(f"most bodies at once: side by side {both}, new code alone {alone}\n{during}\n{after}")
    assert both == 1, "side by side, the old code's cap of 1 holds"
    assert "0/1" in during and "0/3" in after, (during, after)
    assert "none; concurrency" in after, "a declaration of no spacing reads none"
    assert alone == 3, "the new cap holds once the old node has stopped (and is used)"
