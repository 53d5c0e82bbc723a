"""A real Prometheus server scrapes ``siq exporter``, and its own query language finds the
queue's start rate at the interval's; every expression of the Grafana dashboard runs."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from siq_celery.backends import backend_from_url
from siq_celery.client.queue import IntervalQueue
from siq_celery.embedded import EmbeddedRedis, free_port
from tests.integration.conftest import busy_queue
from tests.integration.test_exporter import start_exporter
from tests.test_docker_files import dashboard_expressions
from tests.tools import require_tool

pytestmark = [pytest.mark.processes, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _prometheus() -> None:
    require_tool("prometheus", "Debian: apt-get install prometheus; .ci/run installs it")


INTERVAL = 0.1


def query(port: int, promql: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


def test_prometheus_sees_the_queue_start_at_its_interval(tmp_path: Path) -> None:
    with EmbeddedRedis() as server, ExitStack() as running:
        IntervalQueue("api", backend=backend_from_url(server.url)).ensure(INTERVAL, reset=True)
        running.enter_context(busy_queue(server.url, "api", 2))  # always one waiting: at the limit
        exporter_port, prom_port = free_port(), free_port()
        exporter = start_exporter(server.url, exporter_port)
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: siq\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n"
        )
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            rate: list[dict[str, object]] = []
            while time.monotonic() < deadline:
                time.sleep(1)
                assert prometheus.poll() is None, prometheus.communicate()[1][-2000:]
                try:  # 15 s of scrapes behind a 10 s window
                    up = query(prom_port, 'count_over_time(siq_up{job="siq"}[1m])')
                    if up and float(up[0]["value"][1]) >= 15:  # type: ignore[index]
                        rate = query(prom_port, 'rate(siq_starts_total{queue="api"}[10s])')
                        break
                except OSError:
                    continue  # not listening yet
            assert rate, "Prometheus gathered no 15 s of scrapes within 60 s"
            [series] = rate
            per_second = float(series["value"][1])  # type: ignore[index]
            print(
                f"\nPrometheus: rate(siq_starts_total[10s]) = {per_second:.3f}/s at a {INTERVAL * 1000:g} ms interval"
            )
            assert per_second == pytest.approx(1 / INTERVAL, rel=0.10)
            [limit] = query(prom_port, 'siq_queue_interval_seconds{queue="api"}')
            assert float(limit["value"][1]) == INTERVAL  # type: ignore[index]
            # Every expression of the Grafana dashboard runs, as Grafana would send it.
            for expr in dashboard_expressions():
                sent = expr.replace("$queue", ".*").replace("$__rate_interval", "10s").replace("$__range", "1m")
                found = query(prom_port, sent)
                if "starts_total" in expr or "lateness" in expr or "backlog" in expr:
                    assert found, f"no series for {sent}"
        finally:
            prometheus.terminate()
            prometheus.communicate(timeout=20)
            exporter.terminate()
            exporter.communicate(timeout=10)
