"""The documentation's own code runs. Every ```` ```python ```` block of README.md and of
the pages under docs/ is run, in order, in a process of its own, on a private Redis in
place of the ``redis://localhost:6379`` it names. A page goes on from the README's first
interval task (its ``app`` and ``geocode``), as the pages say; a page that uses Spark also
gets ``spark``, a SparkSession, as the PySpark shell has one. Code the pages show from
examples/ (``{literalinclude}``) runs in tests/test_examples.py; ``make docs`` (in .ci/run)
builds the pages with warnings as errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
TASK = re.compile(r"^@app\.task\(.*\)\ndef (\w+)", re.M)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


PAGES = [path.name for path in sorted((ROOT / "docs").glob("*.md")) if python_blocks(path)]


def uses_spark(path: Path) -> bool:
    return any("spark." in block for block in python_blocks(path))


def run_pages(names: list[str], server: str) -> None:
    """Run in a subprocess (``python -c``): the README's blocks, then each page's, in one
    namespace; print the app's interval tasks, each with its queues, and every queue's
    last ticket, as JSON."""
    from siq_celery import IntervalTask

    namespace: dict[str, Any] = {"__name__": "docs"}
    paths = [README, *(ROOT / "docs" / name for name in names)]
    if any(uses_spark(path) for path in paths):
        from siq_celery.spark.session import spark_session

        namespace["spark"] = spark_session("local[2]", "siq docs")
    for path in paths:
        for block in python_blocks(path):
            exec(compile(block.replace("redis://localhost:6379", server), str(path), "exec"), namespace)
    app = namespace["app"]
    app.finalize(auto=True)  # every task the pages declared is built, and its declaration checked
    tasks = {name: task for name, task in app.tasks.items() if isinstance(task, IntervalTask)}
    queues = {name: [q.name for q in task.siq_declared_queues()] for name, task in tasks.items()}
    statuses = {q.name: q.backend.status(q.name) for task in tasks.values() for q in task.siq_declared_queues()}
    tickets = {name: status.state.ticket for name, status in statuses.items() if status is not None}
    print(json.dumps({"tasks": queues, "tickets": tickets}))
    if "spark" in namespace:
        namespace["spark"].stop()


def run(redis_url: str, *pages: str) -> dict[str, Any]:
    server = redis_url.rsplit("/", 1)[0]
    code = f"from tests.test_docs import run_pages; run_pages({list(pages)!r}, {server!r})"
    try:
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=150)
    finally:
        client = redis.Redis.from_url(f"{server}/1")  # the README's state store
        client.flushdb()
        client.close()
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def declared(path: Path) -> set[str]:
    return {f"docs.{name}" for block in python_blocks(path) for name in TASK.findall(block)}


def test_the_readmes_first_interval_task_publishes_with_a_ticket(redis_url: str) -> None:
    ran = run(redis_url)
    assert ran["tasks"] == {"docs.geocode": ["geocoder"]}
    assert ran["tickets"] == {"geocoder": 1}  # geocode.delay("1 Main St") claimed the first ticket


SPARK = (pytest.mark.spark, pytest.mark.slow)


@pytest.mark.parametrize(
    "page", [pytest.param(name, marks=SPARK if uses_spark(ROOT / "docs" / name) else ()) for name in PAGES]
)
def test_the_code_of_each_page_runs(redis_url: str, page: str) -> None:
    ran = run(redis_url, page)
    assert declared(ROOT / "docs" / page) | {"docs.geocode"} == set(ran["tasks"]), ran
    print(f"{page}: {len(python_blocks(ROOT / 'docs' / page))} block(s) ran; {ran}")


def test_the_pages_with_code_are_found() -> None:
    assert {"tasks.md", "limits.md", "queue.md", "pipeline.md"} <= set(PAGES), PAGES


def test_the_api_reference_lists_every_option_of_interval_task() -> None:
    """Each option of IntervalTask documented in its class (a ``#:`` comment) is in the API
    reference's ``:members:`` of it (autodoc shows only those listed)."""
    from sphinx.pycode import ModuleAnalyzer

    documented = {
        name for cls, name in ModuleAnalyzer.for_module("siq_celery.task").find_attr_docs()
        if cls == "IntervalTask" and name.islower()
    }  # fmt: skip
    api = (ROOT / "docs" / "api.rst").read_text()
    members = re.search(r"autoclass:: siq_celery\.IntervalTask\n\s+:members: (.*?)\n\s+:show", api, re.S)
    assert members is not None
    listed = {name.strip() for name in members.group(1).split(",")}
    assert {"interval", "fair_key", "fair_weight"} <= documented
    assert documented - listed == set()
