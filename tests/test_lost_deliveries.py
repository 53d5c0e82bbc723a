"""IntervalTask and poison messages, without workers (eager runs, one SQLite store): a
task whose deliveries were lost with their worker ``siq_max_lost_deliveries`` times
fails with LostDeliveriesError and one log line; retries are not lost deliveries."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from siq_celery import ConfigurationError, IntervalTask
from siq_celery.tasks.settings import SiqSettings


def make_app(tmp_path: Any, **conf: Any) -> Celery:
    app = Celery("lost", broker="memory://", set_as_current=False)
    app.conf.update(siq_url=f"sqlite:///{tmp_path}/s.db", task_always_eager=True, **conf)
    return app


def test_a_task_lost_with_its_worker_three_times_fails_clearly_and_once(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path)
    ran: list[int] = []

    @app.task(base=IntervalTask, shared=False, interval="10ms", interval_queue="poison", name="pkg.crash")
    def crash(n: int) -> int:
        ran.append(n)
        return n

    queue = crash.siq_queue()
    for _ in range(3):  # three deliveries authorized, and each time the worker process died
        queue.wait_for_turn(task_id="crash-1")
    with caplog.at_level(logging.INFO, logger="siq_celery"):
        result = crash.apply((1,), task_id="crash-1")
    lines = [r for r in caplog.records if r.name == "siq_celery" and r.levelno >= logging.ERROR]
    print(f"\nthe 4th delivery: state {result.state}, {result.result!r}; ran {ran}")
    assert result.state == "FAILURE" and type(result.result).__name__ == "LostDeliveriesError"
    assert ran == [], "the body did not run again"
    assert len(lines) == 1 and "crash-1" in lines[0].getMessage() and "siq_max_lost_deliveries" in lines[0].getMessage()
    assert "\n" not in str(result.result)
    assert crash.apply((1,), task_id="crash-1").state == "IGNORED", "refused once: a later copy is a finished task's"
    assert crash.apply((2,), task_id="healthy").get() == 2 and ran == [2]


def test_retries_are_not_lost_deliveries(tmp_path: Any) -> None:
    app = make_app(tmp_path, siq_max_lost_deliveries=2)
    runs: list[int] = []

    @app.task(base=IntervalTask, shared=False, interval="10ms", interval_queue="flaky", bind=True, max_retries=5)
    def flaky(self: Any) -> int:
        runs.append(self.request.retries)
        if self.request.retries < 5:
            raise self.retry(countdown=0)
        return len(runs)

    assert flaky.apply().get() == 6 and runs == [0, 1, 2, 3, 4, 5]


def test_the_limit_is_a_setting_with_a_default_of_three() -> None:
    app = Celery("s", broker="memory://", set_as_current=False)
    app.conf.siq_url = "memory://"
    assert SiqSettings.from_app(app).max_lost_deliveries == 3
    app.conf.siq_max_lost_deliveries = 0  # off
    assert SiqSettings.from_app(app).max_lost_deliveries == 0
    for bad in (-1, "3", 1000):
        app.conf.siq_max_lost_deliveries = bad
        with pytest.raises(ConfigurationError, match="siq_max_lost_deliveries"):
            SiqSettings.from_app(app)
