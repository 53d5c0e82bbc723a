"""Every example runs exactly as its README says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.processes


def test_standalone_example_runs_as_written() -> None:
    result = subprocess.run(
        [sys.executable, "examples/standalone/limited_api.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 21 and lines[-1].startswith("OK: 20 calls, smallest gap")


def test_standalone_example_on_redis(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "examples/standalone/limited_api.py", "--url", redis_url, "--calls", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("OK: 12 calls")
