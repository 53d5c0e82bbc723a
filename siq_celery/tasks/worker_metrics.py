"""A worker's own Prometheus metrics (``siq_metrics_port``): its main process serves, from
``worker_ready`` to ``worker_shutdown``, what ``siq exporter`` would (the collector of
observe/metrics.py on the server of observe/metrics_http.py), read from the store. Pool processes are not
involved, so it is prefork-safe."""

from __future__ import annotations

import logging
from typing import Any

from .app_state import siq_state
from .declarations import app_declarations
from .task_api import has_interval_tasks

logger = logging.getLogger("siq_celery")


class WorkerMetrics:
    """The metrics servers of a worker's main process, one per app with ``siq_metrics_port``;
    :meth:`serve` is connected to ``worker_ready``, :meth:`stop` to ``worker_shutdown``."""

    def __init__(self) -> None:
        self.servers: list[Any] = []

    def serve(self, sender: Any = None, **_: Any) -> None:
        """With ``siq_metrics_port``: the exporter's metrics from this worker's main process.
        A port already taken (two nodes on one host) is logged, not fatal."""
        app = getattr(sender, "app", None)
        if app is None or not has_interval_tasks(app):
            return
        state = siq_state(app)
        port = state.settings.metrics_port
        if port is None:
            return
        from ..observe.metrics import StoreCollector
        from ..observe.metrics_http import serve

        patterns = metrics_patterns(app)
        if not patterns:
            logger.warning("siq_celery: the app's interval queues are named per key, so the metrics on port %s cover "
                           "none: set siq_metrics_queues to their patterns, say ['shop:*']", port)  # fmt: skip
        try:
            self.servers.append(serve(StoreCollector(state.backend, patterns), port))
        except OSError as exc:
            logger.error("siq_celery: cannot serve metrics on port %s: %s", port, exc)
            return
        logger.info("siq_celery: metrics of %s on http://0.0.0.0:%s/metrics", ", ".join(patterns) or "no queue", port)

    def stop(self, **_: Any) -> None:
        while self.servers:
            server = self.servers.pop()
            server.shutdown()
            server.server_close()  # the port, too


def metrics_patterns(app: Any) -> tuple[str, ...]:
    """The queues a worker's metrics cover: ``siq_metrics_queues``, else the fixed queues
    its tasks declare. Per-key queues have no fixed names: none of them, unless
    ``siq_metrics_queues`` names their pattern (never every queue of the store)."""
    return siq_state(app).settings.metrics_queues or tuple(q.name for q in app_declarations(app))
