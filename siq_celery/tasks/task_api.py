"""What the two sides of an interval task use of it: the producer side (tasks/publish.py) and
the worker side (tasks/gate.py) type against :class:`IntervalTaskLike`, and tasks/task.py, which
builds :class:`~siq_celery.tasks.task.IntervalTask` from both, satisfies it. Neither side
imports tasks/task.py, so the modules form no import circle. The worker's signal handlers know
an interval task by its ``siq_queue`` (:func:`is_interval_task`)."""

from __future__ import annotations

from typing import Any, Protocol

from ..client.combined import CombinedQueue
from ..client.queue import IntervalQueue
from ..errors import ConfigurationError


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


#: The options of an interval task (IntervalTask's attributes). Celery's task decorator
#: makes options class attributes of any base, so on another base they are read by no one
#: and the task runs unlimited: :func:`check_interval_options` refuses them.
INTERVAL_OPTIONS = (
    "interval", "interval_queue", "burst", "quota", "concurrency", "margin", "cost", "fair_key", "fair_weight",
)  # fmt: skip


def check_interval_options(app: Any) -> None:
    """Raise ConfigurationError (one line) for the first task of ``app`` that is not an
    interval task but was given an interval task's option (``@app.task(interval="1s")``
    without ``base=IntervalTask``). Reads the tasks ``app`` holds, never finalizing it."""
    checked: set[str] = app.__dict__.setdefault("_siq_options_checked", set())
    for name, task in list(getattr(app, "_tasks", {}).items()):
        if name in checked or is_interval_task(task):
            continue
        declared = vars(type(task))
        for option in INTERVAL_OPTIONS:
            if option in declared:
                base = next((b for b in type(task).__bases__), type(task))
                raise ConfigurationError(
                    f"task {name}: {option}= is an option of IntervalTask, and this task's base is "
                    f"{base.__module__}.{base.__qualname__}: give it base=IntervalTask "
                    f"(@app.task(base=IntervalTask, {option}=...)), or it runs unlimited"
                )
        checked.add(name)
