"""``siq top`` in a real terminal (tmux): it shows each queue with its rate, its backlog
and its state while starts go on, and quits on ``q``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from siq_celery.backends import backend_from_url
from siq_celery.client.queue import IntervalQueue
from siq_celery.embedded import EmbeddedRedis
from tests.integration.conftest import busy_queue
from tests.tools import require_tool

pytestmark = [pytest.mark.processes]

SIQ = str(Path(sys.executable).parent / "siq")

Rows = dict[str, list[str]]


@pytest.fixture(autouse=True)
def _tmux() -> None:
    require_tool("tmux", "apt-get install tmux")


#: A tmux server of this test run's own: it starts with this process's environment (the
#: PYTHONPATH of the tree under test), whatever other tmux servers run on the machine.
SOCKET = f"siq-test-{os.getpid()}"


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True, timeout=10)


@contextmanager
def watch_top(url: str, until: Callable[[Rows], bool], timeout: float = 20.0, width: int = 120) -> Iterator[Rows]:
    """Run ``siq top`` on ``url`` in a tmux pane ``width`` columns wide; give its table's
    rows (by queue) once ``until`` holds of them (or at the timeout), then check that it
    quits on ``q``."""
    require_tool("tmux", "apt-get install tmux")
    session = f"siq-top-{uuid.uuid4().hex[:8]}"
    # The pane's own size, not the COLUMNS and LINES a test runner may have exported.
    command = f"env -u COLUMNS -u LINES {SIQ} --url {url} top"
    opened = tmux("new-session", "-d", "-s", session, "-x", str(width), "-y", "12", command)
    assert opened.returncode == 0, opened.stderr
    try:
        rows: Rows = {}
        screen = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.5)
            screen = tmux("capture-pane", "-p", "-t", session).stdout
            rows = {cells[0]: cells for cells in (re.split(r"\s*│\s*", line.strip("│ ")) for line in
                    screen.splitlines() if line.startswith("│"))}  # fmt: skip
            if until(rows):
                break
        print(f"\n{screen}")
        yield rows
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 5
        while tmux("has-session", "-t", session).returncode == 0:
            assert time.monotonic() < deadline, "siq top did not quit on q"
            time.sleep(0.1)
    finally:
        tmux("kill-session", "-t", session)


def test_top_shows_rate_backlog_and_pause_and_quits_on_q() -> None:
    with EmbeddedRedis() as server, ExitStack() as running:
        IntervalQueue("api", backend=backend_from_url(server.url)).ensure(0.05, reset=True)
        held = IntervalQueue("shop:1", backend=backend_from_url(server.url))
        held.ensure(0.2, reset=True)
        held.pause()
        running.enter_context(busy_queue(server.url, "api", 4))  # four callers at 50 ms: a backlog of about 3

        def measured(rows: Rows) -> bool:  # the rate, over a few seconds
            return "api" in rows and rows["api"][1] != "-" and float(rows["api"][1]) > 15

        with watch_top(server.url, measured) as rows:
            api, shop = rows["api"], rows["shop:1"]
            # rate/s against the 50 ms limit; the first readings are a second apart, and one
            # start more in a window that short reads as 21/s
            assert 15 < float(api[1]) <= 22 and api[2] == "20.00"
            assert 1 <= int(api[4]) <= 4 and api[9] == "running"  # backlog: the callers waiting in line
            assert shop[2] == "5.00" and shop[9] == "paused"


def test_top_shows_what_binds_beyond_the_interval() -> None:
    """A quota's use of its window, the burst and the bodies in flight against the cap, in a
    ``limits`` column (the fifth) as ``siq status`` shows them; a cap alone has no rate limit
    to show."""
    with EmbeddedRedis() as server:
        backend = backend_from_url(server.url)
        api = IntervalQueue("api", interval="10ms", quota="5/1m", burst=2, concurrency=3, backend=backend)
        api.ensure(reset=True)
        cap = IntervalQueue("cap", interval=None, concurrency=2, backend=backend)
        cap.ensure(reset=True)
        held = [api.wait_for_turn(task_id=f"t{n}") for n in range(2)]  # running: their leases held
        assert all(d.lease for d in held) and cap.wait_for_turn(task_id="c").lease

        with watch_top(server.url, lambda rows: "api" in rows and "cap" in rows, width=160) as rows:
            assert rows["api"][2] == "100.00" and rows["api"][4] == "2/5 in 1m, burst 2, in flight 2/3"
            assert rows["cap"][2] == "-" and rows["cap"][4] == "in flight 1/2"


def test_top_in_80_columns_keeps_queue_names_whole() -> None:
    """A terminal of 80 columns: every queue's name whole, the state kept, the columns that
    do not fit left out (late max first)."""
    with EmbeddedRedis() as server:
        backend = backend_from_url(server.url)
        names = ("shop:eu-west:orders", "{tenant-0042}search")
        for name in names:
            IntervalQueue(name, interval="200ms", backend=backend).ensure(reset=True)
        IntervalQueue("api", interval="10ms", quota="40/20s", burst=2, concurrency=3, backend=backend).ensure(
            reset=True
        )
        with watch_top(server.url, lambda rows: all(n in rows for n in names), width=80) as rows:
            assert all(rows[n][-1] == "running" and len(rows[n]) < 10 for n in names), rows  # some columns left out
            assert not any("…" in cell for cells in rows.values() for cell in cells), rows
