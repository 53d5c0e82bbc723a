"""The app under test for ``celery_app`` and ``celery_worker``, as a project's conftest.py
gives it: siq_celery's pytest plugin wires each test's store to this app."""

from __future__ import annotations

from typing import Any

import pytest
import tasks

# Celery's in-process worker: pytest-celery 1.x replaces ``celery_worker`` with one in a
# Docker container, and this import takes the in-process one back (without pytest-celery,
# siq_celery's plugin activates Celery's fixtures and this line changes nothing).
from celery.contrib.pytest import celery_worker  # noqa: F401


@pytest.fixture
def celery_app() -> Any:
    """``tasks.app`` on Celery's in-memory broker, results sent straight back."""
    tasks.app.conf.update(broker_url="memory://", result_backend="rpc://", worker_hijack_root_logger=False)
    return tasks.app
