"""What can be checked of docker/ without a Docker engine."""

from __future__ import annotations

import importlib
import json
import re
import tomllib
from pathlib import Path

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
