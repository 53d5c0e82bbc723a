"""siq_celery's own traffic is JSON and evaluates nothing.

* No module or Lua script of siq_celery mentions pickle or evaluates code (a static scan;
  comments are left out, docstrings and strings are not).
* What siq_celery adds to a message (the ticket headers, the ETA, the deferral count) is
  plain JSON, str and int only, and every message it publishes (a task, a deferral, a
  released parked task), as it lies in the Redis broker, is a JSON envelope with a JSON
  body, in an app that accepts JSON only.
* A parked task is stored as JSON text, and arguments JSON cannot carry are refused.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.exceptions import Ignore
from hypothesis import given
from hypothesis import strategies as st
from kombu.exceptions import EncodeError

import siq_celery
from siq_celery import IntervalTask, SiqError
from siq_celery.messages import DEFERRALS, HEADER_NAMES
from siq_celery.tasks.parking import parked_message, release_due
from siq_celery.tasks.task import install

PACKAGE = Path(siq_celery.__file__).resolve().parent
SIQ_HEADERS = (*HEADER_NAMES, DEFERRALS)
_apps = itertools.count()

# -- (a) static: nothing pickles, nothing evaluates -----------------------------------

PY_FORBIDDEN = {
    "pickle": re.compile(r"pickle", re.IGNORECASE),  # pickle, cPickle, cloudpickle, serializer="pickle"
    "pickle content type": re.compile(r"x-python-serialize"),
    "marshal": re.compile(r"\bmarshal\b"),
    "shelve": re.compile(r"\bshelve\b"),
    "dill": re.compile(r"\bdill\b"),
    "eval(": re.compile(r"(?<![\w.])eval\s*\("),
    "exec(": re.compile(r"(?<![\w.])exec\s*\("),
    "compile(": re.compile(r"(?<![\w.])compile\s*\("),  # the builtin, not re.compile
    "__import__(": re.compile(r"__import__\s*\("),
    "yaml.load(": re.compile(r"yaml\.(?:unsafe_|full_)?load(?:_all)?\s*\("),
    "loadstring": re.compile(r"loadstring"),
}
LUA_FORBIDDEN = {
    "loadstring": re.compile(r"loadstring"),
    "load(": re.compile(r"(?<![\w.])load\s*\("),
    "dofile/loadfile": re.compile(r"\b(?:dofile|loadfile)\b"),
    "EVAL from a script": re.compile(r"""['"](?:EVAL|EVALSHA|SCRIPT)['"]""", re.IGNORECASE),
    "pickle": re.compile(r"pickle", re.IGNORECASE),
}


def python_code_lines(source: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of Python source with its comments blanked out."""
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    yield from enumerate(lines, start=1)


def lua_code_lines(source: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of Lua source with its comments blanked out (``--`` to the end
    of the line, and ``--[[ ... ]]`` blocks), string literals kept."""
    out, i, quote, block = [], 0, "", False
    while i < len(source):
        c = source[i]
        if block:
            if source.startswith("]]", i):
                block, i = False, i + 2
                continue
            out.append("\n" if c == "\n" else "")
        elif quote:
            out.append(c)
            if c == "\\":
                out.append(source[i + 1 : i + 2])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            out.append(c)
        elif source.startswith("--[[", i):
            block, i = True, i + 4
            continue
        elif source.startswith("--", i):
            end = source.find("\n", i)
            i = len(source) if end < 0 else end
            continue
        else:
            out.append(c)
        i += 1
    yield from enumerate("".join(out).splitlines(), start=1)


def forbidden_uses(path: Path, source: str) -> list[str]:
    if path.suffix == ".py":
        patterns, lines = PY_FORBIDDEN, python_code_lines(source)
    else:
        patterns, lines = LUA_FORBIDDEN, lua_code_lines(source)
    return [
        f"{path}:{number}: {what}: {text.strip()}"
        for number, text in lines
        for what, pattern in patterns.items()
        if pattern.search(text)
    ]


def test_no_module_or_script_of_siq_celery_pickles_or_evaluates_code() -> None:
    files = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")])
    assert sum(f.suffix == ".py" for f in files) >= 20 and sum(f.suffix == ".lua" for f in files) >= 10, files
    found = [use for f in files for use in forbidden_uses(f.relative_to(PACKAGE.parent), f.read_text("utf-8"))]
    assert not found, "siq_celery must stay JSON-only and evaluate nothing:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("name", "source", "expected"),
    [
        ("m.py", "import pickle\n", ["pickle"]),
        ("m.py", "app.conf.task_serializer = 'pickle'\n", ["pickle"]),
        ("m.py", "x = eval(text)\n", ["eval("]),
        ("m.py", "exec (code)\n", ["exec("]),
        ("m.py", "code = compile(src, 'f', 'exec')\n", ["compile("]),
        ("m.py", "data = yaml.load(stream)\n", ["yaml.load("]),
        ("m.py", "import marshal\n", ["marshal"]),
        ("m.py", 'def f():\n    """Never pickle."""\n', ["pickle"]),  # a docstring is not a comment
        ("m.py", "x = 1  # not pickle, never eval(x)\n", []),
        ("m.py", "pattern = re.compile('x'); client.eval(script)\n", []),
        ("s.lua", "local f = loadstring(ARGV[1])\n", ["loadstring"]),
        ("s.lua", "local f = load(ARGV[1])\n", ["load("]),
        ("s.lua", "redis.call('EVAL', ARGV[1], 0)\n", ["EVAL from a script"]),
        ("s.lua", "-- never loadstring(x)\nlocal s = siq_load(KEYS[1])\n", []),
        ("s.lua", "--[[ load(x)\n dofile ]] return 1\n", []),
        ("s.lua", "return 'a -- b' .. loadstring\n", ["loadstring"]),
    ],
)
def test_the_scan_finds_what_it_looks_for_and_skips_comments(name: str, source: str, expected: list[str]) -> None:
    assert [use.split(": ")[1] for use in forbidden_uses(Path(name), source)] == expected


# -- a JSON-only app on a real (private) Redis: broker and store ------------------------


@pytest.fixture
def json_app(redis_url: str) -> Iterator[Celery]:
    """An app that accepts JSON only, its broker on a database of the private Redis that
    this fixture flushes before and after, its store on the (flushed) database 0."""
    broker = redis_url.rsplit("/", 1)[0] + "/7"
    broker_client = redis.Redis.from_url(broker)
    broker_client.flushdb()
    app = Celery(f"json{next(_apps)}", broker=broker, set_as_current=False)
    app.conf.update(
        siq_url=redis_url,
        siq_horizon=1.0,  # tasks more than 1 s from their slot are parked
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=False,
    )
    yield app
    app.close()
    broker_client.flushdb()
    broker_client.close()


def broker_messages(app: Celery) -> list[dict[str, Any]]:
    """The messages waiting in the broker's ``celery`` list, as stored: JSON envelopes."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(raw) for raw in reversed(client.lrange("celery", 0, -1))]
    finally:
        client.close()


def strict_json(text: str | bytes) -> Any:
    """``json.loads`` that also refuses NaN and Infinity (not JSON, though Python writes them)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def message_body(envelope: dict[str, Any]) -> Any:
    assert envelope["content-type"] == "application/json" and envelope["content-encoding"] == "utf-8"
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    return strict_json(body)


def assert_plain_siq_headers(headers: dict[str, Any]) -> None:
    mine = {k: v for k, v in headers.items() if k in SIQ_HEADERS}
    assert set(HEADER_NAMES) <= set(mine), headers
    for key, value in mine.items():
        assert type(value) in (str, int), (key, value)  # not bool, float, bytes or a datetime
    assert strict_json(json.dumps(mine)) == mine
    assert headers.get("eta") is None or isinstance(headers["eta"], str)  # an ISO text, set from the store clock


def test_every_message_siq_celery_publishes_is_json_with_plain_headers(json_app: Celery) -> None:
    sent: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    @json_app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="json-only", name="json.job")
    def job(n: Any) -> None: ...

    @json_app.task(base=IntervalTask, shared=False, interval="500ms", interval_queue="json-defer", name="json.later")
    def later(n: Any) -> None: ...

    install()  # siq_celery's own receivers first (connected when an interval task first binds)
    signals.before_task_publish.connect(capture, weak=False)  # so this one runs after them
    try:
        job.delay(1)  # the claim's reply is read in before_task_publish; its slot is 1 s out
        job.apply_async((2,), countdown=0.5, headers={"mine": "kept"})  # a long backlog now: parked
        job.apply_many([(3,), ({"k": [4, "x"]},)])  # parked too
        run_worker_side(job, 5)  # a delivery 5 s before its slot: the worker parks it
        queue = job.siq_queue()
        parked = queue.backend.parked_tasks(queue.name)
        assert len(parked) == 4
        for task in parked:  # (c) as stored: JSON text, and no ticket of its own inside
            message = strict_json(task.message)
            assert not set(message["options"]["headers"]) & set(HEADER_NAMES)
        assert release_due(json_app, queue, horizon_us=10**12, margin=0.0) == 4  # all back to the broker
        run_worker_side(later, 6)  # 0.5 s before its slot: re-published (deferred)
    finally:
        signals.before_task_publish.disconnect(capture)
    assert len(sent) == 6
    for headers in sent:
        assert_plain_siq_headers(headers)
    assert sent[-1][DEFERRALS] == 1 and sent[-2][DEFERRALS] == 1  # deferred, and parked by the worker
    envelopes = broker_messages(json_app)
    assert len(envelopes) == 6
    for envelope in envelopes:  # what a worker reads: JSON through and through
        assert_plain_siq_headers(envelope["headers"])
        assert isinstance(message_body(envelope), list)  # protocol 2: [args, kwargs, embed]
    assert sorted(json.dumps(message_body(e)[0]) for e in envelopes) == sorted(
        json.dumps(a) for a in ([1], [2], [3], [{"k": [4, "x"]}], [5], [6])
    )


def run_worker_side(task: Any, n: int) -> None:
    """What a worker does with a delivery of ``task(n)`` whose slot is not yet due (the
    worker side runs in ``before_start``): it goes back to wait, and this delivery ends."""
    queue = task.siq_queue()
    ticket = queue.claim()
    headers = {"siq_queue": ticket.queue, "siq_ticket": ticket.number, "siq_epoch": ticket.epoch}
    task_id = f"worker-side-{n}"
    task.push_request(
        id=task_id, args=[n], kwargs={}, headers=headers, is_eager=False, hostname="unit@test",
        delivery_info={"exchange": "", "routing_key": "celery"}, retries=0,
    )  # fmt: skip
    try:
        with pytest.raises(Ignore):
            task.before_start(task_id, [n], {})
    finally:
        task.pop_request()


# -- (c) parked messages ------------------------------------------------------------

JSON_NATIVE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=6,
)


@given(
    args=st.lists(JSON_NATIVE, max_size=4),
    kwargs=st.dictionaries(st.text(), JSON_NATIVE, max_size=3),
    headers=st.dictionaries(st.sampled_from([*SIQ_HEADERS, "mine", "x-trace"]), JSON_NATIVE, max_size=4),
)
def test_a_parked_message_is_json_text_that_publishes_the_same_call(
    args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any]
) -> None:
    options = {"headers": headers, "task_id": "t-1", "eta": "2030-01-01T00:00:00", "countdown": 5, "priority": None}
    text = parked_message("pkg.task", args, kwargs, options)
    message = strict_json(text)
    assert message["task"] == "pkg.task" and message["args"] == args and message["kwargs"] == kwargs
    stored = message["options"]
    assert "eta" not in stored and "countdown" not in stored and "priority" not in stored
    kept = {k: v for k, v in headers.items() if not k.startswith("siq_")}
    if headers.get(DEFERRALS) is not None:
        kept[DEFERRALS] = headers[DEFERRALS]
    assert stored["headers"] == kept  # the ticket comes back from the store at release, never from here


@pytest.mark.parametrize(
    "value", [{1, 2}, frozenset({1}), object(), 1j, Ellipsis], ids=["set", "frozenset", "object", "complex", "ellipsis"]
)
def test_parking_refuses_arguments_json_cannot_carry(value: Any) -> None:
    # (NaN and Infinity are written bare, as Celery's own JSON serializer writes them.)
    with pytest.raises((TypeError, ValueError, EncodeError, SiqError)):
        parked_message("pkg.task", [value], {}, {"headers": {}})


def test_a_task_parked_with_arguments_json_cannot_carry_fails_like_a_publish(json_app: Celery) -> None:
    @json_app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="json-refuse", name="json.refuse")
    def job(n: Any) -> None: ...

    with pytest.raises(EncodeError):  # a normal publish refuses a set like this
        job.delay({1, 2})
    job.delay(1)
    job.delay(2)  # the backlog is long now: parked
    queue = job.siq_queue()
    parked = queue.status().parked
    assert parked >= 1
    with pytest.raises(EncodeError):  # the same error, however long the backlog
        job.delay({1, 2})
    assert queue.status().parked == parked


def test_apply_many_with_an_argument_json_cannot_carry_publishes_and_parks_nothing(json_app: Celery) -> None:
    @json_app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="json-many", name="json.many")
    def job(n: Any) -> None: ...

    with pytest.raises(Exception):  # noqa: B017 - which error is the other test's business
        job.apply_many([(1,), (2,), ({3},)])  # 1 is due within the horizon, 2 and {3} are not
    queue = job.siq_queue()
    published, parked = len(broker_messages(json_app)), len(queue.backend.parked_tasks(queue.name))
    assert (published, parked) == (0, 0), f"{published} published and {parked} parked of a call that raised"
