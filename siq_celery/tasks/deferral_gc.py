"""A garbage collection in a worker process every so many deferrals.

Celery ends an ignored task with an ExceptionInfo whose copied traceback (billiard keeps
every frame's code positions, some 200 KB) is cyclic garbage that Python's oldest
generation rarely collects: measured, 5,000 deferrals grew each pool process by 100 MB.
A collection every 20 deferrals keeps it within a few MB."""

from __future__ import annotations

import gc
from typing import Any

from .task_api import is_interval_task

#: Full garbage collections in a worker process: one per this many deferrals.
COLLECT_EVERY_DEFERRALS = 20


class DeferralCollector:
    """Connected to ``task_postrun``: counts the deferrals (``IGNORED``) of interval tasks."""

    def __init__(self, every: int = COLLECT_EVERY_DEFERRALS) -> None:
        self.every, self.since_collect = every, 0

    def __call__(self, sender: Any = None, state: str | None = None, **_: Any) -> None:
        if state != "IGNORED" or not is_interval_task(sender):
            return
        self.since_collect += 1
        if self.since_collect >= self.every:
            self.since_collect = 0
            gc.collect()
