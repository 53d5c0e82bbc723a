"""``siq demo`` runs as the README says: real workers, a summary, a PNG timeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import HOST_CLOCK_RERUNS, host_clock

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]


def test_demo_runs_real_workers_and_draws_the_timeline(tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, "-m", "siq_celery.demo", "--workers", "2", "--tasks", "20", "--interval", "50ms",
         "--out", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "20/20 started" in out and "achieved rate" in out
    host_clock("0 below it" in out, "the demo saw body gaps below the interval: " + out)
    assert out.count("demo0@siq/") + out.count("demo1@siq/") >= 2  # starts per worker, both nodes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args", [["--tasks", "1"], ["--workers", "0"], ["--interval", "0ms"]])
def test_bad_demo_arguments_are_refused_before_anything_starts(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "siq_celery.demo", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "private redis-server" not in result.stdout
