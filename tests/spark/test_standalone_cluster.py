"""``siq audit`` on a real Spark standalone cluster: a master and two workers started with
``spark-class`` from the installed PySpark, on this machine. The report must be the one
``local[2]`` gives, and both workers must have run executors of the audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from siq_celery.embedded import free_port
from siq_celery.spark.synthetic import write_synthetic_ledger

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.processes]

BIN = Path(sys.executable).parent
ENV = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def _state(ui_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as reply:
        state: dict[str, Any] = json.load(reply)
    return state


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, list[Path]]]:
    """spark://127.0.0.1:PORT of a master with two one-core workers; its web UI port; the
    workers' work folders (where each executor leaves a folder per application)."""
    tmp = tmp_path_factory.mktemp("spark-cluster")
    port, ui_port = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(BIN / "spark-class")
    procs = [
        _spawn([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                "--webui-port", str(ui_port)], tmp / "master.log")
    ]  # fmt: skip
    work = [tmp / f"worker{i}" for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _state(ui_port)
                break
            except OSError:
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    pytest.fail(f"the Spark master did not start: {(tmp / 'master.log').read_text()[-2000:]}")
                time.sleep(0.5)
        for i, folder in enumerate(work):
            procs.append(_spawn(
                [spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--cores", "1",
                 "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(folder)],
                tmp / f"worker{i}.log",
            ))  # fmt: skip
        while len([w for w in _state(ui_port)["workers"] if w["state"] == "ALIVE"]) < 2:
            if time.monotonic() > deadline:
                logs = "".join((tmp / f"worker{i}.log").read_text()[-1500:] for i in range(2))
                pytest.fail(f"two Spark workers did not register: {logs}")
            time.sleep(0.5)
        yield url, ui_port, work
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _audit(master: str, ledger: Path, out: Path) -> subprocess.Popen[str]:
    """``siq audit`` of ``ledger`` on ``master``, started (see :func:`_report`)."""
    return subprocess.Popen(
        [str(BIN / "siq"), "audit", str(ledger), "--out", str(out), "--master", master, "--rows-per-piece", "10000",
         "--conf", "spark.sql.shuffle.partitions=4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip


def _report(audit: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    try:
        stdout, stderr = audit.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        audit.kill()
        raise
    assert audit.returncode == 0, stdout + stderr[-3000:]
    assert "synthetic:one: 60,000 starts" in stdout, stdout
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


@pytest.mark.timeout(420)  # two Spark applications and a cluster's start on a shared 2-core host
def test_the_audit_on_a_standalone_cluster_matches_local_mode(
    standalone_cluster: tuple[str, int, list[Path]], tmp_path: Path
) -> None:
    master, ui_port, work = standalone_cluster
    ledger = tmp_path / "ledger.parquet"
    write_synthetic_ledger(str(ledger), 60_000, violations=20, inversions=20, duplicates=20, missing=20,
                           queues=[("synthetic:one", 20_000)])  # fmt: skip
    # side by side: each is mostly a JVM's start and Spark's per-stage latency, not work
    audits = {name: _audit(m, ledger, tmp_path / name) for name, m in (("cluster", master), ("local", "local[2]"))}
    on_cluster, local = (_report(audits[name], tmp_path / name) for name in ("cluster", "local"))
    for name in ("summary", "by_day", "by_hour", "gaps", "rate", "workers"):
        assert on_cluster[name] == local[name], name
    [q] = on_cluster["summary"]
    assert (q["starts"], q["violations"], q["inversions"], q["duplicate_starts"], q["missing_tickets"]) == (
        60_000,
        20,
        20,
        20,
        20,
    )
    # the work was spread: the master saw the application, and each worker ran an executor of it
    apps = [a for a in _state(ui_port)["completedapps"] if a["name"] == "siq audit"]
    assert apps, "the master never saw the audit"
    for folder in work:
        assert (folder / apps[0]["id"]).is_dir(), f"no executor of {apps[0]['id']} ran in {folder}"
