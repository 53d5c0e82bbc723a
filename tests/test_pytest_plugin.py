"""siq_celery's pytest plugin (siq_celery/pytest_plugin.py), used as a project's tests use
it: Celery's ``celery_app`` with interval tasks, Celery's in-process ``celery_worker``, and
the plugin's store, pinned clock and private Redis. (examples/testing runs it as a user's
own test file, with and without pytest-celery's plugin: tests/test_examples.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from siq_celery import IntervalTask
from siq_celery.pytest_plugin import FollowEtas, SiqStore, wired
from siq_celery.tasks.app_state import siq_state
from siq_celery.testing import PinnedClock

US = 1_000_000


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    """Celery's test app with an interval task: 1 s apart in queue ``plugin``."""

    held: set[str] = set()

    @celery_app.task(base=IntervalTask, interval="1s", interval_queue="plugin", name="plugin.work", bind=True)
    def work(self: Any, n: int, hold: float = 0.0) -> int:
        if hold and self.request.id not in held:  # once
            held.add(self.request.id)
            self.siq_backoff(hold)
        return n

    celery_app.conf.result_backend = "rpc://"
    return celery_app


def test_tasks_run_through_the_worker_at_their_slots_on_the_pinned_clock(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    start = siq_clock.now_us
    results = [celery_app.tasks["plugin.work"].delay(n) for n in range(3)]
    assert [r.get(timeout=10) for r in results] == [0, 1, 2]
    starts = siq_store.starts("plugin")
    assert [(row.ticket, row.start_us - start, row.outcome) for row in starts] == [
        (1, 1 * US, "SUCCESS"), (2, 2 * US, "SUCCESS"), (3, 3 * US, "SUCCESS"),
    ]  # fmt: skip
    assert siq_clock.now_us == start + 3 * US  # it moved only as far as the starts waited
    status = siq_store.status("plugin")
    assert (status.state.current, status.finished) == (3, 3)


def test_the_store_is_wired_before_the_worker_whatever_the_order_of_the_arguments(
    celery_worker: Any, siq_store: SiqStore, celery_app: Any
) -> None:
    """The worker announced its queue's interval to this test's store as it started."""
    assert "plugin" in siq_store.backend.queues()  # (with any shared task's: Celery's default is shared=True)
    assert siq_store.status("plugin").state.interval_us == 1 * US
    assert siq_state(celery_app).backend is siq_store.backend


@pytest.mark.celery(task_always_eager=True)
def test_an_eager_call_waits_on_the_pinned_clock(celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock) -> None:
    start = siq_clock.now_us
    assert [celery_app.tasks["plugin.work"].delay(n).get() for n in range(3)] == [0, 1, 2]
    assert [row.start_us - start for row in siq_store.starts("plugin")] == [1 * US, 2 * US, 3 * US]


def test_the_store_is_the_tests_own_and_the_app_gets_its_own_back(tmp_path: Any) -> None:
    app = Celery("own", broker="memory://", set_as_current=False)
    app.conf.siq_url = f"sqlite:///{tmp_path}/own.db"
    own = siq_state(app)
    clock = PinnedClock()
    with wired(app, "memory://plugin-own", clock) as store:
        assert app.conf.siq_url == store.url == "memory://plugin-own"
        assert siq_state(app).backend is store.backend and store.backend.now_us() == clock.now_us
        store.queue("q").ensure("1s")
        assert store.backend.queues() == ["q"]
    assert siq_state(app) is own and app.conf.siq_url == f"sqlite:///{tmp_path}/own.db"
    assert own.backend.queues() == []


@pytest.mark.parametrize(
    ("eta", "followed"),
    [
        (timedelta(seconds=30), True),  # a back-off's, a deferral's, a slot's: on the store's clock
        (timedelta(days=1), True),
        (timedelta(seconds=-5), False),  # past: the clock never goes back
        (timedelta(days=900), False),  # a countdown of the caller's own: on the host's clock, years on
        (None, False),
    ],
)
def test_the_clock_follows_the_etas_of_interval_tasks_on_the_store_clock(eta: timedelta | None, followed: bool) -> None:
    clock = PinnedClock()
    app = object()
    pinned = datetime.fromtimestamp(clock.now_us / US, UTC)
    delivered = pinned + eta if eta is not None else None
    task = SimpleNamespace(
        app=app, siq_queue=lambda: None, request=SimpleNamespace(eta=delivered and delivered.isoformat())
    )
    FollowEtas(app, clock)(sender=task)
    assert clock.now_us == (
        round(delivered.timestamp() * US) if followed and delivered else round(pinned.timestamp() * US)
    )
    FollowEtas(object(), clock)(sender=SimpleNamespace(app=app, siq_queue=lambda: None, request=SimpleNamespace(
        eta=(pinned + timedelta(days=2)).isoformat())))  # fmt: skip
    assert clock.now_us < round((pinned + timedelta(days=2)).timestamp() * US), "another app's task moves nothing"


def test_a_back_off_passes_on_the_pinned_clock(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    start = siq_clock.now_us
    assert celery_app.tasks["plugin.work"].delay(7, hold=300).get(timeout=10) == 7
    starts = [(row.start_us - start, row.outcome) for row in siq_store.starts("plugin")]
    assert starts == [(1 * US, "BACKOFF"), (301 * US, "SUCCESS")], "five minutes' hold, in milliseconds"


@pytest.mark.processes
def test_the_redis_store_is_shared_with_other_processes(
    celery_app: Any, siq_redis_store: SiqStore, celery_worker: Any
) -> None:
    assert siq_redis_store.clock is None  # Redis keeps the time: every process reads the same clock
    assert celery_app.tasks["plugin.work"].delay(1).get(timeout=10) == 1
    other = subprocess.run(
        [sys.executable, "-m", "siq_celery.cli", "--url", siq_redis_store.url, "status", "--json", "plugin"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert other.returncode == 0, other.stderr
    (status,) = json.loads(other.stdout)
    assert (status["queue"], status["current"], status["finished_recorded"]) == ("plugin", 1, 1)
