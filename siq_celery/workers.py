"""Start and stop real ``celery worker`` processes (for the demo, the benchmarks and the
tests). Each worker runs in its own process group, so stopping or killing it takes its
pool children too, as when a host goes down."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import SiqError


class WorkerStartError(SiqError):
    """A worker exited or did not report ready; the message ends with its log."""


class WorkerProcess:
    """``celery -A APP worker -n NAME -c N -P POOL`` as a subprocess, logging to a file."""

    def __init__(
        self,
        app: str,
        name: str,
        logfile: Path,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
    ) -> None:
        self.app, self.name, self.logfile = app, name, Path(logfile)
        self.concurrency, self.pool = concurrency, pool
        self.env = {**os.environ, **(env or {})}
        self.extra_args, self.cwd = list(extra_args), cwd
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", self.app, "worker", "-n", self.name,
            "-c", str(self.concurrency), "-P", self.pool, "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat", *self.extra_args,
        ]  # fmt: skip

    def start(self) -> WorkerProcess:
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(self.logfile, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
            )
        return self

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def wait_ready(self, timeout: float = 60.0) -> WorkerProcess:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"{self.name} ready." in self.log():
                return self
            if self.process.poll() is not None:
                raise WorkerStartError(
                    f"worker {self.name} exited with {self.process.returncode}:\n{self.log()[-3000:]}"
                )
            time.sleep(0.1)
        raise WorkerStartError(f"worker {self.name} not ready after {timeout:.0f}s:\n{self.log()[-3000:]}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.process is not None
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once (a host that died)."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it takes longer than ``timeout``."""
        if not self.alive:
            return
        assert self.process is not None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        else:
            with contextlib.suppress(ProcessLookupError):  # pool children that outlived their parent
                os.killpg(self.process.pid, signal.SIGKILL)
