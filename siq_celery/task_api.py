"""What the two sides of an interval task use of it: the producer side (publish.py) and
the worker side (gate.py) type against :class:`IntervalTaskLike`, and task.py, which
builds :class:`~siq_celery.task.IntervalTask` from both, satisfies it. Neither side
imports task.py, so the modules form no import circle. The worker's signal handlers know
an interval task by its ``siq_queue`` (:func:`is_interval_task`)."""

from __future__ import annotations

from typing import Any, Protocol

from .combined import CombinedQueue
from .queue import IntervalQueue


class IntervalTaskLike(Protocol):
    """A Celery task with an interval queue (an IntervalTask)."""

    name: str
    app: Any
    request: Any
    send_events: bool

    def siq_queue(self, args: Any = None, kwargs: Any = None) -> IntervalQueue: ...
    def siq_line(self, args: Any, kwargs: Any) -> tuple[IntervalQueue, IntervalQueue | CombinedQueue]: ...
    def siq_cost(self, args: Any = None, kwargs: Any = None) -> int: ...
    @property
    def siq_per_key(self) -> bool: ...
    @property
    def siq_fair(self) -> bool: ...
    def siq_fair_share(self, args: Any = None, kwargs: Any = None) -> tuple[str, int]: ...
    def signature_from_request(self, request: Any, args: Any, kwargs: Any, **options: Any) -> Any: ...
    def send_event(self, type_: str, retry: bool = True, retry_policy: Any = None, **fields: Any) -> None: ...
    def AsyncResult(self, task_id: str, **kwargs: Any) -> Any: ...


def is_interval_task(task: object) -> bool:
    """Whether ``task`` is an interval task, known by its ``siq_queue`` method (the worker's
    signal handlers import neither the task class nor parking)."""
    return callable(getattr(task, "siq_queue", None))


def has_interval_tasks(app: Any) -> bool:
    return any(is_interval_task(t) for t in list(app.tasks.values()))
