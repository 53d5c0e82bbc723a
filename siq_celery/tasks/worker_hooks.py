"""What siq_celery does in a worker around its interval tasks, through Celery's signals.

* ``worker_init`` (main process, before any task is taken): refuse to start on a kombu
  whose Redis transport lacks what siq_celery patches (broker/kombu_api.py), or with a task
  given an interval task's option on another base; note whether task events are sent and
  whether the pool is green (gevent, eventlet: broker/admission.py), guard the Redis broker's
  paused replies (broker/unread_replies.py), announce the node's interval declarations
  (tasks/declarations.py), and warn of a Redis store that may evict keys.
* ``worker_process_init`` / ``worker_ready``: connect to the store and load its scripts,
  so a fresh process's first task is not late; start the upkeep thread (tasks/upkeep.py), which
  on a green pool with a Redis broker also restores dead workers' tasks (broker/restore.py).
* ``worker_ready`` with ``siq_metrics_port`` set: serve Prometheus metrics from the main
  process (tasks/worker_metrics.py), read from the store like ``siq exporter``.
* ``worker_shutdown``: stop the upkeep thread and the metrics server, and withdraw the
  node's declarations; ``worker_process_shutdown``: a pool process withdraws the per-key
  declarations it made.
* ``task_postrun``: collect the garbage Celery's ``Ignore`` leaves after deferrals
  (tasks/deferral_gc.py).

It connects the signals; the jobs are in their modules (tasks/declarations.py, tasks/upkeep.py,
tasks/worker_metrics.py, broker/check.py for the warning about the broker's redelivery time,
tasks/deferral_gc.py). What a worker process keeps between signals is one object, ``WORKER``.

It knows interval tasks by their ``siq_queue`` method (task_api.is_interval_task), so it
imports neither the task class nor parking.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any, NoReturn

from celery import signals

from ..broker import green
from ..broker.check import warn_if_broker_forgets_before_horizon
from ..broker.green_credit import add_green_credit
from ..broker.kombu_api import kombu_problem
from ..broker.restore import UnackedRestore, needs_restore_sweep, redis_broker
from ..broker.transit import TransitSweep
from ..broker.unread_replies import guard_unread_replies
from ..errors import ConfigurationError, StoreUnavailableError, redacted, redacted_url
from .app_state import siq_state
from .declarations import NodeDeclarations, PerKeyDeclarations, app_declarations
from .deferral_gc import DeferralCollector
from .task_api import check_interval_options, has_interval_tasks
from .upkeep import WorkerUpkeep
from .worker_metrics import WorkerMetrics

logger = logging.getLogger("siq_celery")


@dataclass
class WorkerProcess:
    """What this worker process keeps between Celery's signals; prefork pool processes
    inherit it (they fork after ``worker_init``)."""

    #: Whether this process runs its tasks on a green pool (gevent, eventlet: monkey-patched
    #: by Celery before anything was imported), noted at worker start: its many waiting
    #: tasks of a queue take their turn in ticket order (broker/admission.py).
    green: bool = False
    #: Whether the worker sends task events (``-E``, ``worker_send_task_events``), noted at
    #: worker start. (Events enabled later by remote control, as Flower can, reach only
    #: the main process: start workers with ``-E``.)
    sends_task_events: bool = False
    #: The per-key declarations of the apps this worker runs: its pool processes withdraw
    #: theirs as they stop.
    per_key_declarations: list[PerKeyDeclarations] = field(default_factory=list)
    #: The upkeep threads of the main process, stopped when the worker shuts down.
    upkeep: list[WorkerUpkeep] = field(default_factory=list)
    #: The metrics servers of the main process (``siq_metrics_port``).
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    #: The garbage collection after deferrals, one per process.
    collect_after_deferrals: DeferralCollector = field(default_factory=DeferralCollector)
    #: Whether a worker starting in this process freezes its startup objects (gc.freeze):
    #: not a test's worker, which runs in the test process (siq_celery.pytest_plugin).
    freezes_startup: bool = True


WORKER = WorkerProcess()


def _note_task_events(sender: Any = None, **_: Any) -> None:
    WORKER.sends_task_events = bool(getattr(sender, "task_events", False))


def _note_green_pool(sender: Any = None, **_: Any) -> None:
    """A green pool: waiting tasks take their turn in ticket order (broker/admission.py), and its
    consumer gets a message of credit more on the Redis broker (broker/green_credit.py)."""
    from kombu.utils.compat import detect_environment

    WORKER.green = green.GREEN = detect_environment() in ("gevent", "eventlet")  # type: ignore[no-untyped-call]
    app = getattr(sender, "app", None)
    if WORKER.green and app is not None and has_interval_tasks(app):
        add_green_credit(app)


def refuse_to_start(line: str) -> NoReturn:
    """Stop a worker of interval tasks before it takes any task: one CRITICAL line, exit
    status 1. (A receiver's Exception is logged and passed over by Celery's signals; a
    SystemExit ends the worker's start.)"""
    logger.critical("siq_celery: %s", line)
    raise SystemExit(1)


def _check_before_start(sender: Any = None, **_: Any) -> None:
    """``worker_init``, first: a node of interval tasks refuses to start when a task of
    its app has an interval task's option on another base (task_api.check_interval_options:
    one defined after the app was finalized), or when the broker is Redis and kombu lacks
    what siq_celery's guards patch (broker/kombu_api.py)."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    try:
        check_interval_options(app)
    except ConfigurationError as exc:
        refuse_to_start(str(exc))
    problem = kombu_problem() if redis_broker(app) else None
    if problem is not None:
        refuse_to_start(f"{problem}. This worker runs interval tasks, so it does not start.")


def _guard_unread_replies(sender: Any = None, **_: Any) -> None:
    """A node of interval tasks never leaves a message unread in a paused BRPOP reply of
    the Redis broker, where a SIGKILL would lose it (broker/unread_replies.py)."""
    app = getattr(sender, "app", None)
    if app is not None and has_interval_tasks(app):
        guard_unread_replies()


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
    WORKER.per_key_declarations.append(state.per_key_declarations)
    declarations.announce()


def _check_store_eviction(sender: Any = None, **_: Any) -> None:
    """A Redis store that may evict keys (any ``maxmemory-policy`` but ``noeviction``: the
    ``allkeys-*`` policies evict anything, the ``volatile-*`` ones the keys with a TTL, as
    per-key queues have) forgets the starts of a queue whose keys it evicted, and then
    authorizes starts beyond its limits: said in one WARNING line at the worker's start,
    with what to set. A user whose ACL forbids CONFIG is told once that it could not be
    read. A WARNING, not a refusal: eviction begins only at ``maxmemory``, and managed Redis
    services ship ``volatile-lru``."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    state = siq_state(app)
    try:
        read = getattr(state.backend, "eviction_policy", None)
        if read is None:  # memory, SQLite: nothing evicts
            return
        policy = read()
    except StoreUnavailableError as exc:  # said by the warm-up and the first tasks
        logger.debug("siq_celery: the state store's maxmemory-policy not read: %s", exc)
        return
    except Exception as exc:
        logger.warning(
            "siq_celery: could not read the state store's maxmemory-policy (%s: %s): make sure it is noeviction, "
            "or Redis may evict a queue's keys and authorize starts beyond its limits", type(exc).__name__,
            redacted(str(exc)).splitlines()[0] if str(exc) else "",
        )  # fmt: skip
        return
    if policy != "noeviction":
        logger.warning(
            "siq_celery: the state store (%s) has maxmemory-policy %s: Redis may evict a queue's keys, and a "
            "queue without them authorizes starts beyond its limits; set maxmemory-policy noeviction on it "
            "(a Redis of its own for siq_url if the broker's must evict)", redacted_url(state.settings.url), policy,
        )  # fmt: skip


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
    for per_key in WORKER.per_key_declarations:
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
    freeze_startup_objects(current_app)


def _warm_worker(sender: Any = None, **_: Any) -> None:
    # threads, solo and green pools run tasks in the worker process itself
    if sender is not None and hasattr(sender, "app"):
        warm_interval_queues(sender.app)
        freeze_startup_objects(sender.app)


def freeze_startup_objects(app: Any) -> None:
    """Leave what the process holds once it is ready (modules, the app, its tasks: some
    50,000 objects, all kept for the process's life) out of the garbage collector's full
    collections (``gc.freeze``). Each full collection otherwise walks them all: 17 ms
    measured on this package's imports alone, a stall in which no task of the process
    starts. On a green pool every waiting task shares that one thread: at 10 ms, bodies
    authorized an interval apart started 2-3 ms apart after such a stall, 0-3 times in
    400 starts."""
    if WORKER.freezes_startup and has_interval_tasks(app):
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()


def _start_upkeep(sender: Any = None, **_: Any) -> None:
    """The worker's own upkeep loop (main process), so an idle fleet still releases
    parked tasks and renews its declarations."""
    app = getattr(sender, "app", None)
    if app is None or not has_interval_tasks(app):
        return
    settings = siq_state(app).settings
    warn_if_broker_forgets_before_horizon(app, settings.horizon)
    # sender: the consumer. Without the event loop (a green pool) nothing else restores
    # a dead worker's unacknowledged tasks on the Redis broker (broker/restore.py).
    restore = UnackedRestore(app) if needs_restore_sweep(sender) else None
    # On a Redis broker, a message lost in a BRPOP reply goes back to its list (broker/transit.py).
    transit = TransitSweep(app) if redis_broker(app) else None
    upkeep = WorkerUpkeep(app, settings.release_every, restore, transit)
    upkeep.start()
    WORKER.upkeep.append(upkeep)


def _stop_upkeep(**_: Any) -> None:
    while WORKER.upkeep:
        WORKER.upkeep.pop().stop()


#: (signal, receiver) in the order they are connected, each once (connect_worker_hooks).
HOOKS: tuple[tuple[Any, Any], ...] = (
    (signals.worker_init, _check_before_start),
    (signals.worker_init, _note_task_events),
    (signals.worker_init, _note_green_pool),
    (signals.worker_init, _guard_unread_replies),
    (signals.worker_init, _announce_declarations),
    (signals.worker_init, _check_store_eviction),
    (signals.task_postrun, WORKER.collect_after_deferrals),
    (signals.worker_process_init, _warm_pool_process),
    (signals.worker_ready, _warm_worker),
    (signals.worker_ready, _start_upkeep),
    (signals.worker_ready, WORKER.metrics.serve),
    # A stopping worker releases nothing more: what it would release is for the workers that
    # stay, and a release as the outage begins must not stand in for the restart (rules.release_cutoff).
    (signals.worker_shutting_down, _stop_upkeep),
    (signals.worker_shutdown, _stop_upkeep),
    (signals.worker_shutdown, WORKER.metrics.stop),
    (signals.worker_shutdown, _withdraw_declarations),
    (signals.worker_process_shutdown, _withdraw_per_key_declarations),
)


def connect_worker_hooks() -> None:
    """Connect the worker's signal handlers (idempotent: each has a ``dispatch_uid``). Not at
    import: importing the package changes nothing outside it; the first interval task bound
    to an app connects them (tasks/task.py), before any worker of that app starts (Celery
    finalizes the app, binding its tasks, before ``worker_init``)."""
    for number, (signal, receiver) in enumerate(HOOKS):
        signal.connect(receiver, weak=False, dispatch_uid=f"siq_celery.worker_hooks.{number}")
