"""Tools some tests drive from outside Python (tmux, a Prometheus server): a test skips,
saying why, where one is missing, except in CI (``CI=true``), where a missing tool fails
the test: a feature is never left untested by a green run."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def require_tool(name: str, install: str) -> str:
    """The path of the program ``name``; else a skip (a fail under ``CI=true``) saying
    how to ``install`` it."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not on PATH ({install})"
        if in_ci():
            pytest.fail(f"{reason}: CI=true needs it, so its tests run", pytrace=False)
        pytest.skip(reason)
    return path
