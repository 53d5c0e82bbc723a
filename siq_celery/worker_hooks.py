"""What siq_celery does in a worker around its interval tasks, through Celery's signals.

* ``worker_init`` (main process, before any task is taken): note whether task events are
  sent, and announce the node's interval declarations (declarations.py).
* ``worker_process_init`` / ``worker_ready``: connect to the store and load its scripts,
  so a fresh process's first task is not late; start the upkeep thread (upkeep.py).
* ``worker_ready`` with ``siq_metrics_port`` set: serve Prometheus metrics from the main
  process (metrics.py), read from the store like ``siq exporter``.
* ``worker_shutdown``: stop the upkeep thread and the metrics server, and withdraw the
  node's declarations.
* ``task_postrun``: collect the garbage Celery's ``Ignore`` leaves after deferrals.

It knows interval tasks by their ``siq_queue`` method, so it imports neither the task
class nor parking.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from celery import signals

from .config import siq_state
from .declarations import NodeDeclarations, PerKeyDeclarations, app_declarations
from .upkeep import WorkerUpkeep

logger = logging.getLogger("siq_celery")


def is_interval_task(task: object) -> bool:
    return callable(getattr(task, "siq_queue", None))


def has_interval_tasks(app: Any) -> bool:
    return any(is_interval_task(t) for t in list(app.tasks.values()))


#: Whether this worker sends task events (``-E``, ``worker_send_task_events``), noted at
#: worker start; prefork pool processes inherit it. (Events enabled later by remote
#: control, as Flower can, reach only the main process: start workers with ``-E``.)
WORKER_SENDS_TASK_EVENTS = [False]


def _note_task_events(sender: Any = None, **_: Any) -> None:
    WORKER_SENDS_TASK_EVENTS[0] = bool(getattr(sender, "task_events", False))


def _announce_declarations(sender: Any = None, **_: Any) -> None:
    """Before the node takes a task: its code's intervals become the declarations (a
    deploy that changed ``interval=`` takes effect here, logged)."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    state = siq_state(app)
    declarations = NodeDeclarations(app, str(getattr(sender, "hostname", "") or ""))
    state.node_declarations = declarations
    state.per_key_declarations = PerKeyDeclarations(state.settings.declaration_ttl)
    declarations.announce()


def _withdraw_declarations(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    declarations = getattr(siq_state(app), "node_declarations", None) if app is not None else None
    if declarations is not None:
        declarations.withdraw()


def warm_interval_queues(app: Any) -> None:
    """Connect to the store and load its scripts for every IntervalTask of ``app``, so the
    first task a fresh worker process runs is not late (a cold start took 60 ms)."""
    for queue in app_declarations(app):
        try:
            queue.backend.warm()
        except Exception as exc:
            logger.warning("siq_celery: could not warm the state store for %r: %s", queue.name, exc)
            return


def _warm_pool_process(**_: Any) -> None:
    from celery import current_app

    warm_interval_queues(current_app)


def _warm_worker(sender: Any = None, **_: Any) -> None:
    # threads and solo pools run tasks in the worker process itself
    if sender is not None and hasattr(sender, "app"):
        warm_interval_queues(sender.app)


_UPKEEP: list[WorkerUpkeep] = []


def _start_upkeep(sender: Any = None, **_: Any) -> None:
    """The worker's own upkeep loop (main process), so an idle fleet still releases
    parked tasks and renews its declarations."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    settings = siq_state(app).settings
    _warn_if_broker_forgets_before_horizon(app, settings.horizon)
    upkeep = WorkerUpkeep(app, settings.release_every)
    upkeep.start()
    _UPKEEP.append(upkeep)


def _stop_upkeep(**_: Any) -> None:
    while _UPKEEP:
        _UPKEEP.pop().stop()


_METRICS_SERVERS: list[Any] = []


def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """With ``siq_metrics_port``: the exporter's metrics from this worker's main process.
    A port already taken (two nodes on one host) is logged, not fatal."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    state = siq_state(app)
    port = state.settings.metrics_port
    if port is None:
        return
    from .metrics import StoreCollector
    from .metrics_http import serve

    patterns = metrics_patterns(app)
    if not patterns:
        logger.warning("siq_celery: the app's interval queues are named per key, so the metrics on port %s cover "
                       "none: set siq_metrics_queues to their patterns, say ['shop:*']", port)  # fmt: skip
    try:
        _METRICS_SERVERS.append(serve(StoreCollector(state.backend, patterns), port))
    except OSError as exc:
        logger.error("siq_celery: cannot serve metrics on port %s: %s", port, exc)
        return
    logger.info("siq_celery: metrics of %s on http://0.0.0.0:%s/metrics", ", ".join(patterns) or "no queue", port)


def metrics_patterns(app: Any) -> tuple[str, ...]:
    """The queues a worker's metrics cover: ``siq_metrics_queues``, else the fixed queues
    its tasks declare. Per-key queues have no fixed names: none of them, unless
    ``siq_metrics_queues`` names their pattern (never every queue of the store)."""
    return siq_state(app).settings.metrics_queues or tuple(q.name for q in app_declarations(app))


def _stop_metrics(**_: Any) -> None:
    while _METRICS_SERVERS:
        server = _METRICS_SERVERS.pop()
        server.shutdown()
        server.server_close()  # the port, too


#: RabbitMQ's default consumer_timeout (30 min): a delivery unacknowledged longer closes the channel.
RABBITMQ_CONSUMER_TIMEOUT_S = 1800.0
REDIS_VISIBILITY_TIMEOUT_S = 3600.0  # kombu's default for the Redis (and SQS) transports


def _warn_if_broker_forgets_before_horizon(app: Any, horizon: float) -> None:
    transport = str(app.conf.broker_url or "").split("://")[0].split("+")[0]
    options = app.conf.broker_transport_options or {}
    if transport in ("redis", "rediss", "sqs", "sentinel"):
        limit, name = float(options.get("visibility_timeout", REDIS_VISIBILITY_TIMEOUT_S)), "visibility_timeout"
    elif transport in ("amqp", "amqps", "pyamqp"):
        limit, name = RABBITMQ_CONSUMER_TIMEOUT_S, "RabbitMQ's default consumer_timeout"
    else:
        return
    if horizon >= limit * 0.9:
        logger.warning(
            "siq_celery: siq_horizon (%.0fs) is not well below the broker's %s (%.0fs): a task waiting by "
            "countdown that long may be redelivered or its channel closed; lower siq_horizon",
            horizon, name, limit,
        )  # fmt: skip


#: Full garbage collections in a worker process: one per this many deferrals.
COLLECT_EVERY_DEFERRALS = 20
_deferrals_since_collect = [0]


def _collect_after_deferrals(sender: Any = None, state: str | None = None, **_: Any) -> None:
    """Celery ends an ignored task with an ExceptionInfo whose copied traceback (billiard
    keeps every frame's code positions, some 200 KB) is cyclic garbage that Python's
    oldest generation rarely collects: measured, 5,000 deferrals grew each pool process by
    100 MB. A collection every 20 deferrals keeps it within a few MB."""
    if state != "IGNORED" or not is_interval_task(sender):
        return
    _deferrals_since_collect[0] += 1
    if _deferrals_since_collect[0] >= COLLECT_EVERY_DEFERRALS:
        _deferrals_since_collect[0] = 0
        gc.collect()


signals.worker_init.connect(_note_task_events, weak=False)
signals.worker_init.connect(_announce_declarations, weak=False)
signals.task_postrun.connect(_collect_after_deferrals, weak=False)
signals.worker_process_init.connect(_warm_pool_process, weak=False)
signals.worker_ready.connect(_warm_worker, weak=False)
signals.worker_ready.connect(_start_upkeep, weak=False)
signals.worker_ready.connect(_serve_metrics, weak=False)
# A stopping worker releases nothing more: what it would release is for the workers that
# stay, and a release as the outage begins must not stand in for the restart (model.release_cutoff).
signals.worker_shutting_down.connect(_stop_upkeep, weak=False)
signals.worker_shutdown.connect(_stop_upkeep, weak=False)
signals.worker_shutdown.connect(_stop_metrics, weak=False)
signals.worker_shutdown.connect(_withdraw_declarations, weak=False)
