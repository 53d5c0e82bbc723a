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
    assert set(services) == {"redis", "worker", "flower", "producer"}
    for name in ("worker", "flower", "producer"):
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
        assert program in ("celery", "python"), program
        return [sys.executable, *(["-m", "celery"] if program == "celery" else []), *args]

    def is_ready(self) -> bool:
        return self._ready()


@pytest.mark.processes
@pytest.mark.slow
def test_every_service_command_runs(redis_url: str, tmp_path: Path) -> None:
    """Worker, Flower and producer exactly as compose.yaml runs them, with a private Redis
    in place of the ``redis`` service, a free port for Flower, and TASKS=10."""
    port = free_port()
    services = compose({**env_example(), "TASKS": "10"})["services"]
    for spec in services.values():
        env = spec.get("environment", {})
        spec["environment"] = {k: str(v).replace("redis://redis:6379/0", redis_url) for k, v in env.items()}
    services["flower"]["command"] = [a.replace("--port=5555", f"--port={port}") for a in services["flower"]["command"]]
    flower_url = f"http://127.0.0.1:{port}/healthcheck"

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
    try:
        worker.start()
        flower.start()
        worker.wait_ready()
        flower.wait_ready()
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
    finally:
        worker.stop(10)
        flower.stop(10)


def test_the_image_installs_as_the_readme_says() -> None:
    install = re.search(r'pip install --no-cache-dir "(\.\[[a-z,]+\])"', DOCKERFILE).group(1)  # type: ignore[union-attr]
    assert f'pip install "{install}"' in (ROOT / "README.md").read_text()
