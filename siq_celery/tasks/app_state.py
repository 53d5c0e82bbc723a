"""What siq_celery keeps per Celery app: its settings (tasks/settings.py), the store client, one
:class:`IntervalQueue` per queue name and one :class:`CombinedQueue` per task of several
limits, and the worker's declarations (tasks/declarations.py).

It is kept on the app (never in a module global) and built lazily, so it is rebuilt after
a fork.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..backends import Backend, backend_from_url
from ..broker.green import nap
from ..client.combined import CombinedQueue, declared_combined_queue
from ..client.queue import IntervalQueue
from ..errors import ConfigurationError, redacted_url
from ..intervals import IntervalLike, parse_interval
from ..limits import Limit, QuotaLike, limits_of
from ..lru import LRUCache
from .settings import SiqSettings


class SiqState:
    """Per-app cache: settings, the store client and one IntervalQueue per queue name.

    ``clock`` (microseconds) replaces the store's clock, ``sleep`` and ``monotonic``
    (seconds) the queues' local time: a test's pinned clock (siq_celery.pytest_plugin),
    never a deployment's."""

    def __init__(
        self, app: Any, *, clock: Callable[[], int] | None = None, sleep: Callable[[float], None] | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.clock = clock
        self.sleep = sleep or nap
        self.monotonic = monotonic or time.monotonic
        self._settings: SiqSettings | None = None
        self._backend: Backend | None = None
        # Bounded (siq_key_cache_size): per-key queues may be many, and idle ones cost nothing.
        self._queues: LRUCache[tuple[object, ...], IntervalQueue] | None = None
        self._by_declaration: LRUCache[tuple[object, ...], IntervalQueue] | None = None
        self._combined: dict[str, CombinedQueue] = {}
        #: The worker node's declarations (main process) and the per-key queues' (pool
        #: processes): tasks/declarations.py; None outside a worker.
        self.node_declarations: Any = None
        self.per_key_declarations: Any = None
        self.declared_queues: list[IntervalQueue] | None = None  #: declarations.app_declarations

    @property
    def settings(self) -> SiqSettings:
        if self._settings is None:
            self._settings = SiqSettings.from_app(self.app)
        return self._settings

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            s = self.settings
            self._backend = backend_from_url(
                s.url,
                key_prefix=s.key_prefix,
                finished_retention_us=round(s.finished_retention * 1e6),
                ledger_max=s.ledger_max,
                max_lost_deliveries=s.max_lost_deliveries,
                lease_timeout_us=round(s.lease_timeout * 1e6),
                clock=self.clock,
                **self._replication(s),
            )
        return self._backend

    @staticmethod
    def _replication(s: SiqSettings) -> dict[str, Any]:
        if not s.store_replicas:
            return {}
        if not s.url.startswith(("redis", "rediss", "unix")):
            raise ConfigurationError(
                f"app.conf.siq_store_replicas = {s.store_replicas}: replicas are a Redis store's; siq_url is "
                f"{redacted_url(s.url)!r}"
            )
        return {"replicas": s.store_replicas, "replica_timeout_ms": max(round(s.store_replica_timeout * 1000), 1)}

    def queue(
        self, name: str, interval: IntervalLike | Limit | None, *, per_key: bool = False, burst: int | None = None,
        quota: QuotaLike | None = None, concurrency: int | None = None, margin: IntervalLike | None = None,
    ) -> IntervalQueue:  # fmt: skip
        """The IntervalQueue ``name``; ``interval`` (or siq_default_interval), ``burst`` and
        ``quota`` (or siq_default_burst, siq_default_quota) are the code's declaration,
        used to create its state (``interval`` may be a :class:`Limit` of all three; a
        quota alone has no spacing). Raises ConfigurationError when no interval and no
        quota is set. A ``per_key`` queue's state expires after ``siq_key_idle_expiry`` of
        idleness."""
        if self._queues is None or self._by_declaration is None:
            self._queues = LRUCache(self.settings.key_cache_size)
            self._by_declaration = LRUCache(self.settings.key_cache_size)
        declaration = (name, interval, burst, quota, concurrency, margin)
        cached = self._by_declaration.get(declaration)
        if cached is not None:  # the publish path: no parsing, no validation
            if per_key:  # the store client's own bounded memory of it may have let it go
                self.backend.expire_when_idle(name, round(self.settings.key_idle_expiry * 1e6))
            return cached
        s = self.settings
        if isinstance(interval, Limit):
            interval_us, limits = interval.resolve(s.default_interval_us)
        else:
            burst = s.default_burst if burst is None else burst
            quota = s.default_quota if quota is None else quota
            concurrency = s.default_concurrency if concurrency is None else concurrency
            margin = s.default_margin if margin is None else margin
            limits = limits_of(burst, quota, concurrency, margin)
            interval_us = parse_interval(interval) if interval is not None else s.default_interval_us
            if interval_us is None and (limits.quota or limits.concurrency):
                interval_us = Limit(quota=quota, concurrency=concurrency).resolve()[0]  # no spacing of its own
        if interval_us is None:
            raise ConfigurationError(
                f"interval queue {name!r} has no interval: give the task interval='200ms' "
                f"(or a rate like '5/s'), or quota='10000/d', or set app.conf.siq_default_interval"
            )
        key = (name, interval_us, limits)
        q = self._queues.get(key)
        if q is None:
            idle = self.settings.key_idle_expiry if per_key else None
            q = self._queues[key] = IntervalQueue(
                name, backend=self.backend, idle_expiry=idle, sleep=self.sleep, monotonic=self.monotonic
            )
            q.interval_us, q.limits = interval_us, limits
        if isinstance(interval, (str, int, float, type(None), Limit)) and not isinstance(quota, list):
            self._by_declaration[declaration] = q  # hashable declarations only
        return q

    def combined(self, task: str, declared: Any, interval: Any) -> CombinedQueue:
        """The CombinedQueue of a task declared with several interval queues (client/combined.py:
        declared_combined_queue), built once: a task's declaration does not change."""
        limits = self._combined.get(task)
        if limits is None:
            limits = self._combined[task] = declared_combined_queue(task, declared, interval, self.queue)
        return limits


def siq_state(app: Any) -> SiqState:
    """The app's SiqState, created on first use."""
    state: SiqState | None = getattr(app, "_siq_state", None)
    if state is None:
        state = SiqState(app)
        app._siq_state = state
    return state


def replace_siq_state(app: Any, state: SiqState | None) -> SiqState | None:
    """Give ``app`` the SiqState ``state`` (None: one built from ``app.conf`` on next use)
    and return the one it had: a test runs the app on a store of its own, then puts the
    app's own state back (siq_celery.pytest_plugin)."""
    previous: SiqState | None = getattr(app, "_siq_state", None)
    app._siq_state = state
    return previous
