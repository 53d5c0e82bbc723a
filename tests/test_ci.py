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
    env = {"PATH": path_without(tmp_path, "tmux", "prometheus", "apt-get"), "CI": ci, "HOME": str(tmp_path)}
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
