"""The documentation's own code runs. Every ```` ```python ```` block of README.md and of
the pages under docs/ is run, in order, in a process of its own, on a private Redis in
place of the ``redis://localhost:6379`` it names. A page goes on from the README's first
interval task (its ``app`` and ``geocode``), as the pages say; a page that uses Spark also
gets ``spark``, a SparkSession, as the PySpark shell has one. ``make docs`` (in .ci/run)
builds the pages with warnings as errors.

Each page reads whole where it is read as plain Markdown (on a code host): no page
includes another file (a ``{include}`` or ``{literalinclude}`` shows there as its raw
directive). A page holds its own copy, between ``<!-- copy: SOURCE -->`` and
``<!-- /copy -->``, of what it shows from elsewhere (the README's sections, BENCHMARKS.md,
the code of examples/), and each copy is checked equal to its source here: edit the
source, then ``python -m tests.test_docs`` pastes every copy again. Copied code runs
where it lives (tests/test_examples.py), not here."""

from __future__ import annotations

import ast
import difflib
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


#: What a page copies: ``<!-- copy: SOURCE -->``, the copy, ``<!-- /copy -->``.
COPY = re.compile(r"^<!-- copy: (.+?) -->\n(.*?)^<!-- /copy -->$", re.M | re.S)
#: SOURCE: a file (a path from the repository's root), with one of ``#MARKER`` (a Markdown
#: file's text between ``<!-- MARKER -->`` and ``<!-- /MARKER -->``), ``::NAME`` (a Python
#: function, its decorators included), or ``from "TEXT"`` (from the first line holding
#: TEXT) and ``to "TEXT"`` (up to the first line after it holding that TEXT).
SOURCE = re.compile(
    r"^(?P<path>[\w./-]+?)(?:#(?P<marker>[\w-]+)|::(?P<name>\w+)"
    r'|(?: from "(?P<start>[^"]+)")?(?: to "(?P<end>[^"]+)")?)$'
)
LANGUAGES = {".py": "python", ".yml": "yaml", ".yaml": "yaml"}
INCLUDE = re.compile(r"^[ \t]*(?:```+|:::+)[ \t]*\{(?:literal)?include\}|^[ \t]*\.\. (?:literal)?include::", re.M)


def copied(source: str) -> str:
    """What a page's copy of ``source`` holds: Markdown as it reads from docs/ (its links
    made relative to docs/), anything else as a fenced block of its language."""
    found = SOURCE.match(source)
    assert found is not None, f"not a copy's source: {source!r}"
    path = ROOT / found["path"]
    text = path.read_text()
    if found["marker"]:
        text = text.split(f"<!-- {found['marker']} -->\n", 1)[1].split(f"<!-- /{found['marker']} -->", 1)[0]
    elif found["name"]:
        function = next(
            node for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == found["name"]
        )  # fmt: skip
        first = min([function.lineno] + [d.lineno for d in function.decorator_list])
        text = "".join(text.splitlines(keepends=True)[first - 1 : function.end_lineno])
    elif found["start"]:
        lines = text.splitlines(keepends=True)
        start = next(n for n, line in enumerate(lines) if found["start"] in line)
        end = next((n for n, line in enumerate(lines) if n > start and found["end"] and found["end"] in line), None)
        text = "".join(lines[start:end])
    if path.suffix == ".md":
        # Links from the repository's root, as from docs/: docs/x.md is x.md, the rest ../
        text = re.sub(r"\]\((?!https?:|#|/)(docs/)?", lambda m: "](" if m[1] else "](../", text)
        return text.strip("\n") + "\n"
    return f"```{LANGUAGES[path.suffix]}\n{text.strip(chr(10))}\n```\n"


def paste_copies() -> None:
    """Paste each page's copies again from their sources (``python -m tests.test_docs``)."""
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        pasted = COPY.sub(lambda m: f"<!-- copy: {m[1]} -->\n{copied(m[1])}<!-- /copy -->", text)
        if pasted != text:
            path.write_text(pasted)
            print(f"pasted the copies of {path.relative_to(ROOT)} again")


def own_text(path: Path) -> str:
    """A page less what it copies."""
    return COPY.sub("", path.read_text())


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(own_text(path))


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
    reference's ``:members:`` of it (autodoc shows only those listed). Read from the source
    as autodoc reads it (a ``#:`` comment right above the attribute), without Sphinx: the
    suite also runs where only the package's floors are installed."""
    source = (ROOT / "siq_celery" / "tasks/task.py").read_text()
    body = source.split("\nclass IntervalTask(", 1)[1].split("\nclass ", 1)[0].split("\ndef ", 1)[0]
    documented = {
        name for name in re.findall(r"^    #:[^\n]*\n(?:    #:[^\n]*\n)*    (\w+)\s*[:=]", body, re.M)
        if name.islower()
    }  # fmt: skip
    api = (ROOT / "docs" / "api.rst").read_text()
    members = re.search(r"autoclass:: siq_celery\.IntervalTask\n\s+:members: (.*?)\n\s+:show", api, re.S)
    assert members is not None
    listed = {name.strip() for name in members.group(1).split(",")}
    assert {"interval", "fair_key", "fair_weight"} <= documented
    assert documented - listed == set()


COPIES = [
    (path.name, source) for path in sorted((ROOT / "docs").glob("*.md")) for source, _ in COPY.findall(path.read_text())
]


def test_no_page_includes_another_file() -> None:
    """On a code host an include directive shows as its raw text, and what it includes not at all."""
    including = {path.name: INCLUDE.findall(path.read_text()) for path in sorted((ROOT / "docs").glob("*.md"))}
    assert {name: found for name, found in including.items() if found} == {}


@pytest.mark.parametrize(("page", "source"), COPIES)
def test_each_copy_on_a_page_equals_its_source(page: str, source: str) -> None:
    expected = copied(source)
    for body in (body for named, body in COPY.findall((ROOT / "docs" / page).read_text()) if named == source):
        if body == expected:
            continue
        diff = difflib.unified_diff(body.splitlines(), expected.splitlines(), page, source, lineterm="")
        pytest.fail(
            f"docs/{page}: its copy of {source} differs from it (`python -m tests.test_docs` pastes every copy "
            "again):\n" + "\n".join(diff)
        )


def test_the_copies_are_found() -> None:
    """The pages that show the quick start, the tests and the benchmarks hold them."""
    assert {
        ("quickstart.md", "README.md#quickstart"), ("limits.md", "README.md#limit-kinds"),
        ("benchmarks.md", "BENCHMARKS.md"), ("reliability.md", "RELIABILITY.md"),
        ("testing.md", "examples/testing/test_tasks.py::test_calls_start_in_ticket_order_one_interval_apart"),
    } <= set(COPIES), COPIES  # fmt: skip


if __name__ == "__main__":
    paste_copies()
