"""State stores, chosen by URL scheme.

``backend_from_url("redis://localhost:6379/0")``, ``"sqlite:///siq.db"``, ``"memory://"``.
A third-party backend registers itself with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from ..errors import UnknownBackendError, redacted_url
from .base import Backend
from .transaction import Transaction
from .transactional import ModelBackend

# Scheme -> "module:Class", imported on first use so that redis-py stays optional.
_REGISTRY: dict[str, str | type[Backend]] = {
    "memory": "siq_celery.backends.memory:MemoryBackend",
    "sqlite": "siq_celery.backends.sqlite:SqliteBackend",
    **{
        scheme: "siq_celery.backends.redis:RedisBackend"
        for scheme in (
            "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel",
        )
    },
}  # fmt: skip


def register_backend(scheme: str, backend: str | type[Backend]) -> None:
    """Make ``scheme://`` URLs build ``backend`` (a class or ``"module:Class"``)."""
    _REGISTRY[scheme] = backend


def backend_class(scheme: str) -> type[Backend]:
    target = _REGISTRY.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise UnknownBackendError(f"no state store is registered for {scheme!r}:// URLs; known: {known}")
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
        _REGISTRY[scheme] = target
    assert isinstance(target, type)
    return target


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build the backend registered for ``url``'s scheme."""
    if not isinstance(url, str) or "://" not in url:
        raise UnknownBackendError(
            f"state store URL {redacted_url(url)!r} has no scheme; use redis://host:6379/0, sqlite:///path.db or memory://"
        )
    return backend_class(urlsplit(url).scheme.lower()).from_url(url, **options)


__all__ = ["Backend", "ModelBackend", "Transaction", "backend_from_url", "backend_class", "register_backend"]
