"""Start and stop real ``celery worker`` and ``celery flower`` processes (for the demo, the
examples, the benchmarks and the tests). Each runs in its own process group, so stopping
or killing a worker takes its pool children too, as when a host goes down."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from .errors import SiqError


class WorkerStartError(SiqError):
    """A worker exited or did not report ready; the message ends with its log."""


class CeleryProcess:
    """A ``celery -A APP ...`` subprocess in its own process group, logging to a file."""

    def __init__(
        self,
        app: str,
        name: str,
        logfile: Path,
        *,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
    ) -> None:
        self.app, self.name, self.logfile = app, name, Path(logfile)
        self.env = {**os.environ, **(env or {})}
        self.extra_args, self.cwd = list(extra_args), cwd
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0  #: where this run's output starts in the log (a restart appends)

    @property
    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> Self:
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.logfile.stat().st_size if self.logfile.exists() else 0
        with open(self.logfile, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
            )
        return self

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def run_log(self) -> str:
        """This run's output only (a restarted process appends to the same log)."""
        if not self.logfile.exists():
            return ""
        return self.logfile.read_bytes()[self._log_start :].decode(errors="replace")

    def is_ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float = 60.0) -> Self:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_ready():
                return self
            if self.process.poll() is not None:
                raise WorkerStartError(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        raise WorkerStartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log()[-3000:]}")

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

    def request_stop(self) -> None:
        """Ask for a warm shutdown: SIGTERM to the main process only. (Pool processes reset
        SIGTERM to its default, so a SIGTERM to the whole group kills running bodies.)"""
        if self.alive:
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown, then SIGKILL if it takes longer than ``timeout``."""
        if not self.alive:
            return
        assert self.process is not None
        self.request_stop()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        else:
            with contextlib.suppress(ProcessLookupError):  # pool children that outlived their parent
                os.killpg(self.process.pid, signal.SIGKILL)


class WorkerProcess(CeleryProcess):
    """``celery -A APP worker -n NAME -c N -P POOL``."""

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
        super().__init__(app, name, logfile, env=env, extra_args=extra_args, cwd=cwd)
        self.concurrency, self.pool = concurrency, pool

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", self.app, "worker", "-n", self.name,
            "-c", str(self.concurrency), "-P", self.pool, "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat", *self.extra_args,
        ]  # fmt: skip

    def is_ready(self) -> bool:
        return f"{self.name} ready." in self.run_log()


class FlowerProcess(CeleryProcess):
    """``celery -A APP flower`` on 127.0.0.1:PORT (Flower's task views need workers
    started with ``-E``)."""

    def __init__(
        self,
        app: str,
        port: int,
        logfile: Path,
        *,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
    ) -> None:
        super().__init__(app, f"flower:{port}", logfile, env=env, extra_args=extra_args, cwd=cwd)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", self.app, "flower",
            "--address=127.0.0.1", f"--port={self.port}", *self.extra_args,
        ]  # fmt: skip

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthcheck", timeout=1) as reply:
                return bool(reply.read() == b"OK")
        except OSError:
            return False
