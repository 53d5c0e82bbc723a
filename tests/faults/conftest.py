"""The fault-injection suite's fixtures: real workers on three private Redis servers
(broker, state store, and the records the tests read), so a fault can hit one of them
while the others keep the evidence."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from siq_celery.embedded import free_port, redis_server_binary, wait_for_own_server
from tests.integration.conftest import ROOT, CeleryRun


class ControlledRedis:
    """A redis-server whose faults a test controls: crash it, stop it with its data saved,
    freeze it (SIGSTOP: connections hang, as behind a dead network), and bring it back on
    the same port. ``persistent`` keeps an append-only file (a broker's usual setting)."""

    def __init__(self, *, persistent: bool = False) -> None:
        self.port = free_port()
        self.persistent = persistent
        self.dir = tempfile.TemporaryDirectory(prefix="siq-fault-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> ControlledRedis:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir.name, "--protected-mode", "no", *aof]  # fmt: skip
        with open(Path(self.dir.name) / "redis.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if wait_for_own_server(self.process, self.port, 10):
            return self
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server on {self.port} exited at start (see {self.dir.name}/redis.log)")
        raise RuntimeError(f"redis-server on {self.port} did not come up")

    def crash(self) -> None:
        """SIGKILL: whatever was not persisted is gone."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def shutdown_saving(self) -> None:
        """Stop with its data on disk (SHUTDOWN SAVE), so a restart brings it all back."""
        assert self.process is not None
        with contextlib.suppress(redis.ConnectionError):  # the server closes the connection as it exits
            redis.Redis(port=self.port).execute_command("SHUTDOWN", "SAVE")
        self.process.wait(10)

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> ControlledRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)
        self.dir.cleanup()


@pytest.fixture
def store() -> Iterator[ControlledRedis]:
    with ControlledRedis() as server:
        yield server


@pytest.fixture
def fault_run(
    store: ControlledRedis, broker: ControlledRedis, records: ControlledRedis, tmp_path: Path
) -> Iterator[CeleryRun]:
    env = {
        "SIQ_TEST_QUEUE": f"siq-fault-{uuid.uuid4().hex[:12]}",
        "SIQ_TEST_BROKER": broker.url(1),
        "SIQ_TEST_STORE": store.url(0),
        "SIQ_TEST_RECORD": records.url(0),
        "SIQ_TEST_INTERVAL": "50ms",
        # Messages of a dead worker come back after 10 s (swept every second); nothing waits
        # by ETA longer than 8 s.
        "SIQ_TEST_TRANSPORT": json.dumps(
            {"visibility_timeout": 10, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        ),
        "SIQ_TEST_HORIZON": "8",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = CeleryRun(env, tmp_path / "logs")
    yield run
    run.close()


def publish(run: CeleryRun, numbers: range, **kwargs: object) -> None:
    task = run.app.tasks["geo.record"]
    for n in numbers:
        task.apply_async((n,), kwargs or None)


def wait_finished(run: CeleryRun, count: int, timeout: float) -> Counter[int]:
    """How often each task finished, once ``count`` distinct tasks did (and a second more,
    so a duplicate, if any, shows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len({f["n"] for f in run.finishes()}) >= count:
            time.sleep(1.0)
            return Counter(f["n"] for f in run.finishes())
        time.sleep(0.2)
    done = {f["n"] for f in run.finishes()}
    missing = sorted(set(range(count)) - done)
    started = {s["n"]: s for s in run.starts()}
    about = [f"task {n}: {'started ' + str(started[n]) if n in started else 'never started'}" for n in missing[:5]]
    ids = {started[n]["task_id"] for n in missing if n in started}
    logs = "\n".join(
        f"--- {w.name}\n{w.log()[-3000:]}\n" + "\n".join(ln for ln in w.log().splitlines() if any(i in ln for i in ids))
        for w in run.workers
    )
    raise AssertionError(f"{len(done)} of {count} finished after {timeout}s; {'; '.join(about)}\n{logs}")
