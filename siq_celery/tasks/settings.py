"""siq_celery's Celery settings: lowercase ``siq_*`` keys in ``app.conf``.

* ``siq_url`` (default: the broker URL when the broker is Redis): the state store.
* ``siq_default_interval`` (``None``): interval of tasks that set none.
* ``siq_default_burst`` (0) and ``siq_default_quota`` (``None``, or ``"N/period"``): burst
  and window quota of tasks that set none (limits.py).
* ``siq_default_concurrency`` (``None``: no cap): concurrency cap of tasks that set none.
* ``siq_default_margin`` (``None``: 0): margin of tasks that set none, a duration added to
  the spacing and to the quota's window (limits.py).
* ``siq_lease_timeout`` (10 s): every start with a task id takes a lease (a concurrency cap
  counts them): while it is live a redelivered copy of the task is not started. A lease of
  a body whose process died (SIGKILL, a hard time limit, a revoke that terminates) expires
  this long after its last renewal, and its copy runs then; a running body's lease is
  renewed every third of it (client/leases.py).
* ``siq_store_replicas`` (0) and ``siq_store_replica_timeout`` (1 s): on a Redis master with
  replicas (Sentinel), a start or a finish counts only once that many replicas acknowledged
  it (``WAIT``) within the timeout: a failover keeps it, and a master cut off from its
  replicas authorizes nothing (docs/design.md, "The guarantees").
  Not on a Redis Cluster URL (``redis+cluster://``): ConfigurationError.
* ``siq_key_prefix`` (``"siq"``): prefix of every store key (two apps on one Redis).
* ``siq_max_sleep`` (0.1 s): waits up to this are slept in the worker process, holding a
  pool slot; longer ones go back to the broker by ETA.
* ``siq_green_max_sleep`` (5 s): the same on a green pool (``-P gevent``, ``-P eventlet``),
  where a wait holds only a greenlet and only the two lowest tickets of a queue in a
  process wait at once (the others wait their turn without asking the store:
  broker/admission.py); a node's lowest ticket may be every other node's greenlets behind the
  head of the line. Never below ``siq_max_sleep``.
* ``siq_countdown_margin`` (0.02 s): a task is brought this much before its slot.
* ``siq_broker_wait_below`` (0.02 s): tasks of a queue whose interval is shorter than this
  wait for their slot in the broker's queue, in ticket order, not by ETA: whichever
  worker process is free takes the next one (an ETA binds a task to the worker node
  that received it, busy or not). 0 sends every task by ETA.
* ``siq_paused_poll`` (1.0 s): a task of a paused queue looks again after this, on a grid
  of the store clock (``celery siq resume`` restarts the line one poll later, so every
  task is back in time to keep its place).
* ``siq_finished_retention`` (86400 s): finished task ids are remembered this long, so a
  redelivered copy is skipped.
* ``siq_max_lost_deliveries`` (3): a task whose worker process died during this many
  runs in a row (it kills the process: out of memory, a crash in a C extension) is not
  started again when the broker hands it back: it fails with LostDeliveriesError and
  one log line (a poison message; RabbitMQ's delivery limit, SQS's dead-letter queue).
  Any finish, a retry's too, starts the count again. 0: no limit; at most 100.
* ``siq_backoff_default`` (60 s): the hold of ``self.siq_backoff(response)`` when the
  response has none of the headers that say when to come back, or one that cannot be
  read (a warning names it): a 429 holds the queue, it does not fail the task. A minute
  is the window of most services' limits; ``siq_backoff(response, default=...)`` wins.
* ``siq_horizon`` (600 s): no task waits by countdown longer than this; tasks whose slot is
  further out are parked in the store (keep it well below the broker's
  ``visibility_timeout`` and RabbitMQ's ``consumer_timeout``).
* ``siq_release_every`` (1.0 s): how often each worker releases parked tasks that came
  within the horizon.
* ``siq_ledger_max`` (100000): about this many starts are kept per queue in the ledger
  (``siq export`` reads it); 0 turns the ledger off.
* ``siq_key_idle_expiry`` (86400 s): the state of a per-key queue (a callable
  ``interval_queue``) disappears from Redis after this long without a claim, start or
  finish, unless it is paused or has parked tasks; it comes back on use.
* ``siq_declaration_ttl`` (30 s): a worker's declaration of its tasks' intervals counts
  this long unless renewed (every third of it); a worker that dies without withdrawing
  its declarations stops holding its queues to its interval after at most this long.
  ``siq_release_every`` must be at most a sixth of it (the renewals run on those rounds).
* ``siq_key_cache_size`` (10000): queues a process keeps ready (client objects, parsed
  declarations), least recently used forgotten first: a worker that sees 100,000 keys
  of a per-key queue holds this many, not all of them.
* ``siq_metrics_port`` (``None``: off): the worker's main process serves the exporter's
  Prometheus metrics (siq_celery.observe.metrics) on this port, for fleets that scrape workers;
  pool processes are not involved, so it is prefork-safe. ``siq_metrics_queues``
  (default: the queues the app's tasks declare): glob patterns of the queues it
  exports, ``["shop:*"]`` for per-key queues.

Precedence: task attribute > app setting > default. :class:`SiqSettings` reads them once
per app (tasks/app_state.py keeps it, with the store client and the queues).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigurationError, redacted_url
from ..intervals import parse_interval
from ..keys import DEFAULT_KEY_PREFIX
from ..ledger import DEFAULT_LEDGER_MAX
from ..limits import parse_quota, validate_burst, validate_concurrency, validate_margin
from .retry_after import DEFAULT_BACKOFF_S, MAX_HOLD_S

REDIS_BROKER_SCHEMES = {"redis", "rediss", "unix"}
DEFAULT_HORIZON_S = 600.0
DEFAULT_MAX_LOST_DELIVERIES = 3
MAX_LOST_DELIVERIES = 100
#: siq_release_every may be at most siq_declaration_ttl / this (SiqSettings.__post_init__).
RENEWALS_PER_TTL = 6


@dataclass(frozen=True)
class SiqSettings:
    url: str
    default_interval_us: int | None
    key_prefix: str
    max_sleep: float
    countdown_margin: float
    broker_wait_below: float
    paused_poll: float
    finished_retention: float
    ledger_max: int
    horizon: float
    release_every: float
    key_idle_expiry: float
    declaration_ttl: float
    key_cache_size: int = 10_000
    metrics_port: int | None = None
    metrics_queues: tuple[str, ...] | None = None
    max_lost_deliveries: int = DEFAULT_MAX_LOST_DELIVERIES
    default_burst: int | None = None
    default_quota: Any = None
    default_concurrency: int | None = None
    default_margin: Any = None
    lease_timeout: float = 10.0
    store_replicas: int = 0
    store_replica_timeout: float = 1.0
    green_max_sleep: float = 5.0
    backoff_default: float = DEFAULT_BACKOFF_S
    #: Celery's task_protocol 1 keeps the ETA in the body: a publish claims before it builds
    #: the message (read once, as the rest: the publish path reads no app.conf).
    protocol_1: bool = False

    @property
    def horizon_us(self) -> int:
        return round(self.horizon * 1e6)

    def __post_init__(self) -> None:
        # A worker renews its declarations on its upkeep rounds (every siq_release_every), the
        # first round after a third of the TTL: up to TTL/3 + release_every apart. At most a
        # sixth of the TTL leaves room for one failed renewal to be retried before the
        # declaration lapses; more, and live declarations lapse between renewals (the
        # effective interval flips each round).
        most = self.declaration_ttl / RENEWALS_PER_TTL
        if self.release_every > most:
            raise ConfigurationError(
                f"app.conf.siq_release_every = {self.release_every:g} is not well below siq_declaration_ttl / 3 "
                f"({self.declaration_ttl / 3:g}s): workers renew their declarations on those rounds, so live "
                f"declarations would lapse between renewals and the effective interval flip. Set "
                f"siq_release_every to at most {most:g} (siq_declaration_ttl / {RENEWALS_PER_TTL}), or "
                f"siq_declaration_ttl to at least {self.release_every * RENEWALS_PER_TTL:g}"
            )

    @classmethod
    def from_app(cls, app: Any) -> SiqSettings:
        conf = app.conf
        url = conf.get("siq_url") or _url_from_broker(conf.get("broker_url"))
        default = conf.get("siq_default_interval")
        return cls(
            url=url,
            default_interval_us=parse_interval(default) if default is not None else None,
            key_prefix=conf.get("siq_key_prefix") or DEFAULT_KEY_PREFIX,
            protocol_1=conf.get("task_protocol") == 1,
            max_sleep=_seconds(conf, "siq_max_sleep", 0.1),
            green_max_sleep=max(_seconds(conf, "siq_green_max_sleep", 5.0), _seconds(conf, "siq_max_sleep", 0.1)),
            countdown_margin=_seconds(conf, "siq_countdown_margin", 0.02),
            broker_wait_below=_seconds(conf, "siq_broker_wait_below", 0.02),
            paused_poll=_seconds(conf, "siq_paused_poll", 1.0, minimum=0.05),
            finished_retention=_seconds(conf, "siq_finished_retention", 86_400.0, minimum=1.0),
            ledger_max=_count(conf, "siq_ledger_max", DEFAULT_LEDGER_MAX),
            horizon=_seconds(conf, "siq_horizon", DEFAULT_HORIZON_S, minimum=1.0),
            release_every=_seconds(conf, "siq_release_every", 1.0, minimum=0.05),
            key_idle_expiry=_seconds(conf, "siq_key_idle_expiry", 86_400.0, minimum=1.0),
            declaration_ttl=_seconds(conf, "siq_declaration_ttl", 30.0, minimum=1.0),
            key_cache_size=max(_count(conf, "siq_key_cache_size", 10_000), 100),
            metrics_port=_port(conf, "siq_metrics_port"),
            metrics_queues=_patterns(conf, "siq_metrics_queues"),
            max_lost_deliveries=_count(
                conf, "siq_max_lost_deliveries", DEFAULT_MAX_LOST_DELIVERIES, maximum=MAX_LOST_DELIVERIES
            ),
            default_burst=_checked_setting(conf, "siq_default_burst", validate_burst),
            default_quota=_checked_setting(conf, "siq_default_quota", parse_quota),
            default_concurrency=_checked_setting(conf, "siq_default_concurrency", validate_concurrency),
            default_margin=_checked_setting(conf, "siq_default_margin", validate_margin),
            lease_timeout=_seconds(conf, "siq_lease_timeout", 10.0, minimum=1.0),
            store_replicas=_count(conf, "siq_store_replicas", 0, maximum=16),
            store_replica_timeout=_seconds(conf, "siq_store_replica_timeout", 1.0, minimum=0.001),
            backoff_default=_seconds(conf, "siq_backoff_default", DEFAULT_BACKOFF_S, maximum=MAX_HOLD_S),
        )


def _checked_setting(conf: Any, key: str, check: Any) -> Any:
    value = conf.get(key)
    if value is not None:
        try:
            check(value)
        except ConfigurationError as exc:
            raise ConfigurationError(f"app.conf.{key} = {value!r}: {exc}") from None
    return value


def _url_from_broker(broker: object) -> str:
    first = str(broker or "").split(";")[0].strip()
    if urlsplit(first).scheme in REDIS_BROKER_SCHEMES:
        return first
    broker = redacted_url(first) if first else "not set"  # never the broker's password
    raise ConfigurationError(
        f"siq_celery needs a state store: the broker ({broker}) is not Redis, so set "
        f"app.conf.siq_url = 'redis://host:6379/1' (or 'sqlite:///path.db' on one host)"
    )


def _seconds(conf: Any, key: str, default: float, minimum: float = 0.0, maximum: float = math.inf) -> float:
    value = conf.get(key)
    if value is None:
        return default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected seconds (a number)") from None
    if not seconds >= minimum or seconds != seconds or seconds == float("inf"):
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected a number of seconds >= {minimum}")
    if seconds > maximum:
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected at most {maximum:g} seconds")
    return seconds


def _port(conf: Any, key: str) -> int | None:
    value = conf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected a TCP port (1-65535) or None")
    return value


def _patterns(conf: Any, key: str) -> tuple[str, ...] | None:
    value = conf.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value or not all(isinstance(p, str) and p for p in value):
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected a list of queue name patterns")
    return tuple(value)


def _count(conf: Any, key: str, default: int, maximum: int | None = None) -> int:
    value = conf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected a whole number >= 0")
    if maximum is not None and value > maximum:
        raise ConfigurationError(f"app.conf.{key} = {value!r}: expected a whole number from 0 to {maximum}")
    return value
