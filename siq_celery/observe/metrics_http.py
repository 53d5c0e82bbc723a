"""Serving :class:`siq_celery.observe.metrics.StoreCollector` with ``prometheus_client``: the
``/metrics`` HTTP server (``siq exporter``, a worker's ``siq_metrics_port``) and one
scrape as text (``siq exporter --once``)."""

from __future__ import annotations

from typing import Any

from .metrics import StoreCollector


def registry_for(collector: StoreCollector) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def serve(collector: StoreCollector, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread; the HTTP server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=registry_for(collector))
    return server


def text(collector: StoreCollector) -> str:
    """One scrape in the Prometheus text format."""
    from prometheus_client import generate_latest

    return generate_latest(registry_for(collector)).decode()
