"""Spark jobs that feed or share an interval queue.

Both run their work inside the executors and need only siq_celery and Celery there (not
your Celery app's module): what they need of the app travels with the job as plain
settings (:class:`TaskTarget`).

Spark may run a partition again after an executor failure; a re-run publishes (or
calls) its rows again, as any Spark side effect would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..client.queue import IntervalQueue
from ..intervals import IntervalLike
from ..tasks.app_state import siq_state

logger = logging.getLogger("siq_celery")

DEFAULT_CHUNK = 500


#: The app settings an executor's publisher needs (the rest stays with the driver's app).
PUBLISH_SETTINGS = ("task_serializer", "task_compression", "task_protocol", "accept_content")


@dataclass(frozen=True)
class TaskTarget:
    """What an executor needs to publish an interval task without the app's module: the
    task's name and declaration (a per-key ``interval_queue`` or ``cost`` callable
    travels with it, serialized by Spark: by reference for a module's function, whose module
    the executors must then import), the broker, the routing and the siq settings."""

    task_name: str
    broker_url: str
    conf: dict[str, Any]
    declaration: dict[str, Any]
    routing: dict[str, Any]

    @classmethod
    def of(cls, task: Any) -> TaskTarget:
        from ..tasks.task import IntervalTask, declared

        if not isinstance(task, IntervalTask):
            raise TypeError(f"submit_dataframe needs an IntervalTask, not {type(task).__name__}")
        app = task.app
        if not task.siq_per_key:  # a task with no interval anywhere fails here, on the driver
            task.siq_queue()
        settings = siq_state(app).settings
        route = app.amqp.router.route({}, task.name)
        broker_queue = route.get("queue")
        routing = {"queue": getattr(broker_queue, "name", broker_queue) or app.conf.task_default_queue}
        if route.get("routing_key"):
            routing["routing_key"] = route["routing_key"]
        conf = {k: app.conf.get(k) for k in app.conf if k.startswith(("siq_", "broker_")) or k in PUBLISH_SETTINGS}
        conf.update(siq_url=settings.url, broker_url=None, broker_connection_retry_on_startup=True)
        return cls(
            task_name=task.name,
            broker_url=app.connection_for_write().as_uri(include_password=True),
            conf={k: v for k, v in conf.items() if v is not None},
            declaration={
                "interval": task.interval,
                "interval_queue": declared(task, task.interval_queue),
                "cost": declared(task, task.cost),
            },
            routing=routing,
        )

    def task(self) -> Any:
        """The task, on an app of its own that only publishes it (in an executor)."""
        from celery import Celery

        from ..tasks.task import IntervalTask

        app = Celery("siq-spark-submit", broker=self.broker_url, set_as_current=False)
        app.conf.update(self.conf)
        app.task(name=self.task_name, base=IntervalTask, shared=False, **self.declaration)(_runs_in_workers)
        return app.tasks[self.task_name]


def _runs_in_workers(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("submit_dataframe's copy of a task only publishes it: workers run the real one")


@dataclass
class PartitionResult:
    partition: int
    rows: int = 0
    published: int = 0  #: sent to the broker, or parked in the store
    parked: int = 0  #: beyond the horizon: parked, released by the workers in time
    claims: int = 0  #: store round trips that claimed tickets (one per queue and chunk)
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.rows - self.published


@dataclass
class SubmitReport:
    partitions: list[PartitionResult]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    @property
    def published(self) -> int:
        return sum(p.published for p in self.partitions)

    @property
    def failed(self) -> int:
        return sum(p.failed for p in self.partitions)

    @property
    def parked(self) -> int:
        return sum(p.parked for p in self.partitions)

    @property
    def claims(self) -> int:
        return sum(p.claims for p in self.partitions)

    def __str__(self) -> str:
        text = f"{self.published:,} of {self.rows:,} rows published in {self.claims} claims"
        if self.parked:
            text += f" ({self.parked:,} parked beyond the horizon)"
        bad = [p for p in self.partitions if p.failed]
        if bad:
            text += "; failed: " + "; ".join(f"partition {p.partition}: {p.failed} rows ({p.errors[0]})" for p in bad)
        return text


def publish_rows(
    target: TaskTarget,
    rows: Iterable[tuple[Sequence[Any], dict[str, Any]]],
    partition: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
) -> PartitionResult:
    """Publish one task per ``(args, kwargs)``, ``chunk_size`` rows at a time as
    ``apply_many`` does: each row claims in its own queue (per-key tasks) with its own
    cost (weighted ones), one store round trip per queue of a chunk, and rows whose slot
    is beyond the horizon are parked in the store, a chunk at a time, instead of waiting
    in a worker. A failed chunk is counted and reported, and the rest goes on."""
    from celery import Task

    from ..tasks.publish import Progress, publish_many

    result = PartitionResult(partition)
    task = target.task()
    send = Task.apply_async.__get__(task)  # Celery's own publish of one message
    try:
        for chunk in _chunks(rows, chunk_size):
            result.rows += len(chunk)
            progress = Progress()
            try:
                publish_many(task, send, chunk, len(chunk), dict(target.routing), progress)
            except Exception as exc:  # reported per partition; the next chunk may still go
                result.errors.append(f"{type(exc).__name__}: {exc}")
                logger.error("partition %d: a chunk of %d rows failed: %s", partition, len(chunk), exc)
            finally:
                result.published += progress.published
                result.parked += progress.parked
                result.claims += progress.claims
    finally:
        siq_state(task.app).backend.close()
        task.app.close()
    return result


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def submit_dataframe(
    df: Any,
    task: Any,
    *,
    args: Sequence[str] | None = None,
    kwargs: Sequence[str] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> SubmitReport:
    """Publish one ``task`` per row of ``df`` from the executors, claiming tickets in bulk.

    ``args``: columns passed positionally, in order; ``kwargs``: columns passed by name
    (default, when neither is given: every column by name). Returns a
    :class:`SubmitReport`: rows, published, failed and claims per partition.
    """
    if not 1 <= chunk_size <= 10_000:
        raise ValueError(f"chunk_size must be 1..10000, not {chunk_size}")
    target = TaskTarget.of(task)
    arg_cols = list(args or [])
    kwarg_cols = list(kwargs) if kwargs is not None else ([] if args else list(df.columns))
    missing = [c for c in [*arg_cols, *kwarg_cols] if c not in df.columns]
    if missing:
        raise ValueError(f"columns not in the DataFrame: {', '.join(missing)}")

    def run(index: int, rows: Iterator[Any]) -> Iterator[PartitionResult]:
        calls = (([row[c] for c in arg_cols], {c: row[c] for c in kwarg_cols}) for row in rows)
        yield publish_rows(target, calls, index, chunk_size)

    report = SubmitReport(sorted(df.rdd.mapPartitionsWithIndex(run).collect(), key=lambda p: p.partition))
    if report.failed:
        logger.error("submit_dataframe: %s", report)
    return report


def interval_map(
    df: Any,
    fn: Callable[[Any], Any],
    *,
    queue: str,
    url: str,
    interval: IntervalLike | None = None,
    key_prefix: str = "siq",
    name: str | None = None,
    schema: Any = None,
) -> Any:
    """Call ``fn(row)`` for every row inside the executors, each call taking its turn in
    the interval queue ``queue`` (shared with Celery workers and other jobs on it).

    Lazy, like any Spark transformation: returns an RDD of the results, or a DataFrame
    with ``schema``. Each call is written to the queue's ledger as ``name`` (default:
    ``fn``'s name).
    """
    label: str = name or getattr(fn, "__qualname__", None) or "interval_map"

    def run(rows: Iterator[Any]) -> Iterator[Any]:
        q = IntervalQueue(queue, url=url, interval=interval, key_prefix=key_prefix)
        try:
            for row in rows:
                with q.slot(name=label):
                    result = fn(row)
                yield result
        finally:
            q.close()

    rdd = df.rdd.mapPartitions(run)
    return rdd.toDF(schema) if schema is not None else rdd
