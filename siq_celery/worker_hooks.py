"""What siq_celery does in a worker around its interval tasks, through Celery's signals.

* ``worker_init`` (main process, before any task is taken): note whether task events are
  sent, and announce the node's interval declarations (declarations.py).
* ``worker_process_init`` / ``worker_ready``: connect to the store and load its scripts,
  so a fresh process's first task is not late; start the upkeep thread (upkeep.py).
* ``worker_ready`` with ``siq_metrics_port`` set: serve Prometheus metrics from the main
  process (metrics.py), read from the store like ``siq exporter``.
* ``worker_shutdown``: stop the upkeep thread and the metrics server, and withdraw the
  node's declarations; ``worker_process_shutdown``: a pool process withdraws the per-key
  declarations it made.
* ``task_postrun``: collect the garbage Celery's ``Ignore`` leaves after deferrals
  (deferral_gc.py).

It connects the signals; the jobs are in their modules (declarations.py, upkeep.py,
metrics.py, broker_check.py for the warning about the broker's redelivery time,
deferral_gc.py).

It knows interval tasks by their ``siq_queue`` method, so it imports neither the task
class nor parking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery import signals

from .app_state import siq_state
from .broker_check import warn_if_broker_forgets_before_horizon
from .declarations import NodeDeclarations, PerKeyDeclarations, app_declarations
from .deferral_gc import DeferralCollector
from .upkeep import WorkerUpkeep

logger = logging.getLogger("siq_celery")


def is_interval_task(task: object) -> bool:
    return callable(getattr(task, "siq_queue", None))


def has_interval_tasks(app: Any) -> bool:
    return any(is_interval_task(t) for t in list(app.tasks.values()))


@dataclass
class WorkerNotes:
    """What this worker process notes about itself; prefork pool processes inherit it."""

    #: Whether the worker sends task events (``-E``, ``worker_send_task_events``), noted at
    #: worker start. (Events enabled later by remote control, as Flower can, reach only
    #: the main process: start workers with ``-E``.)
    sends_task_events: bool = False


WORKER = WorkerNotes()


def _note_task_events(sender: Any = None, **_: Any) -> None:
    WORKER.sends_task_events = bool(getattr(sender, "task_events", False))


#: The per-key declarations of the apps this worker runs: its pool processes (forked after
#: worker_init) withdraw theirs as they stop.
PER_KEY_DECLARATIONS: list[PerKeyDeclarations] = []


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
    PER_KEY_DECLARATIONS.append(state.per_key_declarations)
    declarations.announce()


def _withdraw_declarations(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    state = siq_state(app)
    if state.node_declarations is not None:
        state.node_declarations.withdraw()
    if state.per_key_declarations is not None:  # threads and solo pools use keys in this process
        state.per_key_declarations.withdraw()


def _withdraw_per_key_declarations(**_: Any) -> None:
    """A pool process stops: the per-key declarations it made stop counting now."""
    for per_key in PER_KEY_DECLARATIONS:
        per_key.withdraw()


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
    warn_if_broker_forgets_before_horizon(app, settings.horizon)
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


#: The garbage collection after deferrals (deferral_gc.py), one per process.
_collect_after_deferrals = DeferralCollector()


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
signals.worker_process_shutdown.connect(_withdraw_per_key_declarations, weak=False)
