"""What can be checked of docker/ without a Docker engine."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from siq_celery.demo_app import STARTS_KEY
from siq_celery.embedded import free_port
from siq_celery.workers import CeleryProcess

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def test_every_copied_path_exists() -> None:
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), source


def test_the_installed_extras_are_declared() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for group in re.findall(r'pip install [^\n]*"\.\[([a-z,]+)\]"', DOCKERFILE):
        for extra in group.split(","):
            assert extra in extras, extra


def test_the_command_runs_an_importable_module() -> None:
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1))  # type: ignore[union-attr]
    assert cmd[:2] == ["python", "-m"]
    module = importlib.import_module(cmd[2])
    assert callable(module.main)


# -- compose.yaml --------------------------------------------------------------------

COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def env_example() -> dict[str, str]:
    lines = (ROOT / "docker" / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def compose(variables: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml parsed, with ``${VAR:-default}`` substituted as Compose does."""
    values = variables or {}
    text = VARIABLE.sub(lambda m: values.get(m.group(1), m.group(2) or ""), COMPOSE_FILE.read_text())
    return dict(yaml.safe_load(text))


def test_compose_parses_and_names_the_services() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", "worker", "flower", "producer", "exporter", "prometheus", "grafana"}
    for name in ("worker", "flower", "producer", "exporter"):
        build = services[name]["build"]
        assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).is_file()


def test_the_worker_service_scales() -> None:
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker  # both would stop --scale worker=4
    assert "-E" in worker["command"]  # Flower needs task events


def test_flower_listens_on_5555() -> None:
    flower = compose()["services"]["flower"]
    assert "5555:5555" in flower["ports"] and "--port=5555" in flower["command"]


def test_every_variable_is_in_the_env_example() -> None:
    used = {m.group(1) for m in VARIABLE.finditer(COMPOSE_FILE.read_text())}
    assert used and used <= set(env_example())


class ComposeService(CeleryProcess):
    """A compose service's entrypoint + command, run here (``celery``/``python`` from this venv)."""

    def __init__(self, spec: dict[str, Any], logfile: Path, env: dict[str, str], ready: Callable[[], bool]) -> None:
        super().__init__("", spec.get("command", ["?"])[0], logfile, env=env, cwd=ROOT)
        self.argv = [*spec.get("entrypoint", []), *spec["command"]]
        self._ready = ready

    @property
    def command(self) -> list[str]:
        program, *args = self.argv
        modules = {"celery": ["-m", "celery"], "siq": ["-m", "siq_celery.cli"], "python": []}
        assert program in modules, program
        return [sys.executable, *modules[program], *args]

    def is_ready(self) -> bool:
        return self._ready()


@pytest.mark.processes
@pytest.mark.slow
def test_every_service_command_runs(redis_url: str, tmp_path: Path) -> None:
    """Worker, Flower, exporter and producer exactly as compose.yaml runs them, with a
    private Redis in place of the ``redis`` service, free ports, and TASKS=10."""
    port = free_port()
    services = compose({**env_example(), "TASKS": "10"})["services"]
    for spec in services.values():
        env = spec.get("environment", {})
        spec["environment"] = {k: str(v).replace("redis://redis:6379/0", redis_url) for k, v in env.items()}
    services["flower"]["command"] = [a.replace("--port=5555", f"--port={port}") for a in services["flower"]["command"]]
    flower_url = f"http://127.0.0.1:{port}/healthcheck"
    metrics_port = free_port()
    services["exporter"]["command"] = [
        redis_url if a == "redis://redis:6379/0" else str(metrics_port) if a == "9808" else a
        for a in services["exporter"]["command"]
    ]

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    def exporter_ready() -> bool:
        try:
            return "siq_up 1.0" in metrics()
        except OSError:
            return False

    def flower_ready() -> bool:
        try:
            with urllib.request.urlopen(flower_url, timeout=1) as reply:
                return bool(reply.read() == b"OK")
        except OSError:
            return False

    worker_log = tmp_path / "worker.log"
    worker = ComposeService(services["worker"], worker_log, services["worker"]["environment"],
                            lambda: " ready." in worker_log.read_text(errors="replace"))  # fmt: skip
    flower = ComposeService(
        services["flower"], tmp_path / "flower.log", services["flower"]["environment"], flower_ready
    )
    exporter = ComposeService(services["exporter"], tmp_path / "exporter.log", {}, exporter_ready)
    try:
        worker.start()
        flower.start()
        exporter.start()
        worker.wait_ready()
        flower.wait_ready()
        exporter.wait_ready()
        producer = subprocess.run(
            ComposeService(services["producer"], tmp_path / "producer.log", {}, lambda: True).command,
            env={**os.environ, **services["producer"]["environment"]}, cwd=ROOT, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert producer.returncode == 0, producer.stdout + producer.stderr
        assert producer.stdout.startswith("published 10 tasks to interval queue 'demo' (100 ms)")
        records = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 30
        while records.llen(STARTS_KEY) < 10:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.1)
        starts = sorted(json.loads(r)["start_us"] for r in records.lrange(STARTS_KEY, 0, -1))
        assert min(b - a for a, b in itertools.pairwise(starts)) >= 100_000
        assert 'siq_starts_total{queue="demo"} 10.0' in metrics()
    finally:
        worker.stop(10)
        flower.stop(10)
        exporter.stop(10)


def test_the_image_installs_as_the_readme_says() -> None:
    install = re.search(r'pip install --no-cache-dir "(\.\[[a-z,]+\])"', DOCKERFILE).group(1)  # type: ignore[union-attr]
    assert f'pip install "{install}"' in (ROOT / "README.md").read_text()


# -- monitoring: exporter, Prometheus, Grafana ---------------------------------------

DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "siq-celery.json"


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    return exprs + [a["expr"] for a in board["annotations"]["list"]]


def test_prometheus_scrapes_the_exporter_service() -> None:
    services = compose()["services"]
    port = services["exporter"]["command"][services["exporter"]["command"].index("--port") + 1]
    assert f"{port}:{port}" in services["exporter"]["ports"]
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"exporter:{port}"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert mounted["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_grafana_is_provisioned_from_the_files_here() -> None:
    grafana = compose()["services"]["grafana"]
    mounted = {v.split(":")[1]: COMPOSE_FILE.parent / v.split(":")[0] for v in grafana["volumes"]}
    provisioning = mounted["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["uid"] == "prometheus"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "siq.yml").read_text())["providers"]
    assert mounted[provider["options"]["path"]].resolve() == DASHBOARD.parent.resolve()
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "siq-celery" and len(board["panels"]) >= 4
    assert {a["name"] for a in board["annotations"]["list"]} == {"Paused", "Backed off"}


def test_the_dashboard_reads_only_metrics_the_exporter_serves(redis_url: str) -> None:
    from siq_celery.backends import backend_from_url
    from siq_celery.observe.metrics import StoreCollector
    from siq_celery.observe.metrics_http import text

    backend = backend_from_url(redis_url, key_prefix="dashboard-test")
    backend.ensure("api", 100_000, "e1")
    body = text(StoreCollector(backend))
    served = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")}
    served |= {f"{name}_{part}" for name in served for part in ("bucket", "sum", "count")}
    used = {name for expr in dashboard_expressions() for name in re.findall(r"\b(siq_\w+)", expr)}
    assert used and used <= served, used - served
    fleet_wide = {"siq_up", "siq_queues_left_out"}
    for expr in dashboard_expressions():  # every per-queue panel follows the dashboard's queue picker
        if set(re.findall(r"\b(siq_\w+)", expr)) - fleet_wide:
            assert 'queue=~"$queue"' in expr, expr


def test_one_version_a_licence_file_and_a_changelog() -> None:
    import importlib.metadata

    import siq_celery

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "siq_celery.__version__"}
    assert importlib.metadata.version("siq_celery") == siq_celery.__version__
    assert project["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {siq_celery.__version__} (" in changelog


def test_every_citation_of_the_design_document_names_one_of_its_sections() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (.+)$", design, re.M))
    cited = []
    for path in [*ROOT.joinpath("siq_celery").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]:
        text = path.read_text()
        assert "DESIGN" + ".md" not in text, f"{path}: cites a file that is not in the repository"
        cited += re.findall(r'docs/design\.md,?\s+"([^"]+)"', text)
    assert cited and set(cited) <= sections, set(cited) - sections
