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

from ..config import siq_state
from ..intervals import IntervalLike
from ..messages import ticket_headers
from ..queue import IntervalQueue

logger = logging.getLogger("siq_celery")

DEFAULT_CHUNK = 500


@dataclass(frozen=True)
class TaskTarget:
    """What an executor needs to publish an interval task without the app's module."""

    task_name: str
    broker_url: str
    broker_options: dict[str, Any]
    routing: dict[str, Any]
    store_url: str
    key_prefix: str
    queue: str
    interval_us: int
    countdown_margin: float
    broker_wait_below: float

    @classmethod
    def of(cls, task: Any) -> TaskTarget:
        from ..task import IntervalTask

        if not isinstance(task, IntervalTask):
            raise TypeError(f"submit_dataframe needs an IntervalTask, not {type(task).__name__}")
        app, queue = task.app, task.siq_queue()
        settings = siq_state(app).settings
        route = app.amqp.router.route({}, task.name)
        broker_queue = route.get("queue")
        routing = {"queue": getattr(broker_queue, "name", broker_queue) or app.conf.task_default_queue}
        if route.get("routing_key"):
            routing["routing_key"] = route["routing_key"]
        return cls(
            task_name=task.name,
            broker_url=app.connection_for_write().as_uri(include_password=True),
            broker_options=dict(app.conf.broker_transport_options or {}),
            routing=routing,
            store_url=settings.url,
            key_prefix=settings.key_prefix,
            queue=queue.name,
            interval_us=queue.interval_us or 0,
            countdown_margin=settings.countdown_margin,
            broker_wait_below=settings.broker_wait_below,
        )


@dataclass
class PartitionResult:
    partition: int
    rows: int = 0
    published: int = 0
    claims: int = 0  #: store round trips that claimed tickets (one per chunk)
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
    def claims(self) -> int:
        return sum(p.claims for p in self.partitions)

    def __str__(self) -> str:
        text = f"{self.published:,} of {self.rows:,} rows published in {self.claims} claims"
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
    """Claim tickets a chunk at a time (one store round trip each) and publish one task per
    ``(args, kwargs)``. A failed chunk is counted and reported, and the rest goes on."""
    from celery import Celery

    from ..publish import eta_for

    result = PartitionResult(partition)
    app = Celery("siq-spark-submit", broker=target.broker_url, set_as_current=False)
    app.conf.update(broker_transport_options=target.broker_options, broker_connection_retry_on_startup=True)
    queue = IntervalQueue(target.queue, url=target.store_url, interval=target.interval_us / 1e6,
                          key_prefix=target.key_prefix)  # fmt: skip
    try:
        with app.producer_or_acquire() as producer:
            for chunk in _chunks(rows, chunk_size):
                result.rows += len(chunk)
                try:
                    tickets = queue.claim_many(len(chunk))
                    result.claims += 1
                    for (args, kwargs), ticket in zip(chunk, tickets, strict=True):
                        app.send_task(
                            target.task_name, args=list(args), kwargs=kwargs, headers=ticket_headers(ticket),
                            eta=eta_for(ticket, target.countdown_margin, target.broker_wait_below),
                            producer=producer, **target.routing,
                        )  # fmt: skip
                        result.published += 1
                except Exception as exc:  # reported per partition; the next chunk may still go
                    result.errors.append(f"{type(exc).__name__}: {exc}")
                    logger.error("partition %d: a chunk of %d rows failed: %s", partition, len(chunk), exc)
    finally:
        queue.close()
        app.close()
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
