"""In CI (``CI=true``) a missing tool fails the run instead of skipping what needs it:
``.ci/run`` stops before the suite, and a test that needs the tool fails; outside CI the
test says it is skipped, and why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH of links to what a shell script needs, without ``tools`` (nor apt-get:
    nothing can be installed) and with a ``make`` that says it was reached."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "env", "id", "dirname", "printf", "cat"):
        if (found := shutil.which(name)) and name not in tools:
            (bin_dir / name).symlink_to(found)
    make = bin_dir / "make"
    make.write_text("#!/bin/sh\necho 'make reached'\nexit 0\n")
    make.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_run_fails_under_ci_when_it_cannot_install_tmux_and_prometheus(tmp_path: Path, ci: str) -> None:
    env = {
        "PATH": path_without(tmp_path, "tmux", "prometheus", "apt-get"),
        "CI": ci,
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
    }
    result = subprocess.run(["bash", str(ROOT / ".ci/run")], env=env, capture_output=True, text=True, timeout=60,
                            executable=shutil.which("bash"))  # fmt: skip
    print(f"CI={ci!r}: exit {result.returncode}; {result.stderr.strip()}")
    assert "missing tmux prometheus" in result.stderr
    if ci:
        assert result.returncode == 1 and "make reached" not in result.stdout
    else:
        assert result.returncode == 0 and "make reached" in result.stdout


@pytest.mark.parametrize("ci", ["true", ""])
def test_the_tmux_test_fails_under_ci_without_tmux_and_skips_outside(tmp_path: Path, ci: str) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "CI": ci}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/integration/test_top.py"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1]
    print(f"CI={ci!r}, no tmux on PATH: exit {result.returncode}; {summary}")
    assert "tmux is not on PATH" in result.stdout
    assert "passed" not in summary and "failed" not in summary  # every test of the file needs tmux
    if ci:
        assert result.returncode == 1 and " error" in summary and "skipped" not in summary
    else:
        assert result.returncode == 0 and " skipped" in summary and "error" not in summary


def floors_of(pyproject: Path, *extras: str) -> subprocess.CompletedProcess[str]:
    """``.ci/floors.py`` (what ``make test-floors`` installs) run on ``pyproject``."""
    script = pyproject.parent / ".ci" / "floors.py"
    if not script.exists():
        script.parent.mkdir()
        script.write_text((ROOT / ".ci" / "floors.py").read_text())
    return subprocess.run([sys.executable, str(script), *extras], capture_output=True, text=True, timeout=30)


def test_the_floors_installed_are_the_declared_ones_and_one_without_a_floor_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "siq_celery"\ndependencies = ["celery>=5.3", "click >= 8.1.2"]\n'
        "[project.optional-dependencies]\n"
        'metrics = ["rich>=13"]  # a comment\nall = ["siq_celery[metrics]"]\nloose = ["foo", "bar<2"]\n'
    )
    result = floors_of(tmp_path / "pyproject.toml", "metrics,all")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["celery==5.3", "click==8.1.2", "rich==13"]
    refused = floors_of(tmp_path / "pyproject.toml", "loose")
    assert refused.returncode == 1 and "not of the form name>=version: foo, bar<2" in refused.stderr
    unknown = floors_of(tmp_path / "pyproject.toml", "nosuch")
    assert unknown.returncode == 1 and "no extra nosuch" in unknown.stderr


def test_the_floors_of_the_package_name_kombu_whose_transport_it_patches() -> None:
    result = floors_of(ROOT / "pyproject.toml", "metrics,spark")
    assert result.returncode == 0, result.stderr
    names = [pin.split("==")[0] for pin in result.stdout.split()]
    assert {"celery", "kombu", "click", "prometheus_client", "rich", "pyspark", "pyarrow", "numpy"} <= set(names)
