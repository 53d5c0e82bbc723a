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


def test_siq_demo_help_lists_the_options_the_readme_names() -> None:
    from click.testing import CliRunner

    from siq_celery.cli import siq

    result = CliRunner().invoke(siq, ["demo", "--help"])
    print(result.output)
    assert result.exit_code == 0
    for option in ("--redis-url", "--workers", "--concurrency", "--tasks", "--interval", "--out"):
        assert option in result.output, option


def drifting_starts(nodes: int = 3, processes: int = 2, count: int = 30) -> list[dict[str, object]]:
    """Demo records whose slots drift from a fixed grid, as real ones do: each authorized
    start comes a little after its slot, and the next slot is an interval after that start."""
    starts, slot = [], 1_790_000_000_000_000
    for n in range(count):
        start_us = slot + 1_300
        worker = f"demo{n % nodes}@siq/{100 + (n // nodes) % processes}"
        starts.append({"n": n, "t": (start_us + 200) / 1e6, "worker": worker, "ticket": n + 1, "start_us": start_us,
                       "slot_us": slot})  # fmt: skip
        slot = start_us + 100_000
    return starts


def test_the_timeline_puts_every_start_on_its_own_slot_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    from siq_celery import demo

    drawn: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig

    def keep(self: matplotlib.figure.Figure, *args: object, **kwargs: object) -> None:
        drawn.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    demo._timeline(drifting_starts(), 0.1, tmp_path / "t.png")
    [ax] = drawn[0].axes
    lines = sorted(float(line.get_xdata()[0]) for line in ax.lines)
    dots = [float(x) for points in ax.collections for x, _ in points.get_offsets()]
    off_ms = max(min(abs(x - line) for line in lines) for x in dots) * 1000
    print(f"title {ax.get_title()!r}; farthest dot {off_ms:.1f} ms from a grid line")
    assert len(dots) == 30 and off_ms < 2, "every dot lies on a grid line"
    assert "3 worker nodes x 2 processes" in ax.get_title()
