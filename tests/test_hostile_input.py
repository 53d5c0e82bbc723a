"""Hostile input, generated: whatever arrives (a setting, a queue name, a command line, a
message's headers), siq_celery either accepts it and behaves, or refuses it with a
SiqError (on the command line: one line and exit 1 or 2) and changes nothing. Never
another exception, never a start that breaks the interval.

The parametrized cases after each property pin the bugs these properties found
(numbers that overflow, lone surrogates in names, malformed store URLs, export times and
a resume grace beyond any date, an epoch with a trailing newline, exports to a folder,
calls JSON cannot carry), now fixed.

Example counts come from the active hypothesis profile (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from siq_celery import (
    ConfigurationError,
    IntervalQueue,
    IntervalTask,
    InvalidIntervalError,
    InvalidQueueNameError,
    SiqError,
    format_interval,
    parse_interval,
)
from siq_celery.backends import Backend, backend_from_url
from siq_celery.backends.memory import MemoryBackend
from siq_celery.cli import siq
from siq_celery.intervals import MAX_INTERVAL_US, MIN_INTERVAL_US, parse_duration
from siq_celery.keys import QueueKeys
from siq_celery.ledger import StartRecord
from siq_celery.messages import DEFERRALS, EPOCH, MAX_TICKET, QUEUE, TICKET, ticket_from_headers
from siq_celery.parked import ParkedTask
from siq_celery.tasks.parking import parked_message
from siq_celery.testing import PinnedClock
from siq_celery.types import QueueState

_HEX = re.compile(r"[0-9a-f]{1,64}")
_FLOAT_MAX_S = 1.7976931348623157e308 / 1e6  # seconds whose microseconds still fit a float
_counter = itertools.count()

# -- strategies ---------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**53 - 2, max_value=2**53 + 2),
    st.sampled_from([-(2**63), 2**63, 2**64 + 1, 10**400, -(10**400)]),
    st.floats(),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=4,
)

_NUMBER_TEXT = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12).map(str),
    st.floats().map(repr),
    st.floats().map(str),
    st.from_regex(r"-?[0-9]{0,4}\.?[0-9]{0,4}([eE][-+]?[0-9]{1,3})?", fullmatch=True),
    st.sampled_from(["nan", "inf", "-inf", "Infinity", "1e400", "0x10", "1_000", "٣", "1,5", "+1", ".5", "5."]),
)
_UNITS = st.sampled_from(
    ["", "us", "µs", "μs", "ms", "s", "sec", "m", "min", "h", "d", "days", "MS", "/s", "/m", "/h", "/d", "/y", "/"]
)
_SPACE = st.sampled_from(["", " ", "\t", "\n", "\u00a0", "\u2003"])
INTERVAL_TEXT = st.builds(lambda a, n, b, u, c: f"{a}{n}{b}{u}{c}", _SPACE, _NUMBER_TEXT, _SPACE, _UNITS, _SPACE)
_EXTREMES = st.sampled_from([1.7976931348623157e308, 1e303, -1e303, 10**400, -(10**400), math.nan, math.inf, -math.inf])
HOSTILE_INTERVALS = st.one_of(
    st.text(max_size=30),
    INTERVAL_TEXT,
    st.floats(),
    st.integers(),
    st.integers(min_value=-(2**1000), max_value=2**1000),
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(0), timedelta(microseconds=999), timedelta(days=1)]),
    st.sampled_from([0, -0.0, 5e-324, 0.000999, 0.0009995, 0.001, 86_400, 86_400.000001, 86_401, 2**63]),
    _EXTREMES,
    _EXTREMES,
    st.booleans(),
    st.none(),
    st.binary(max_size=10),
    st.lists(st.integers(), max_size=3),
    st.fractions(),
    st.decimals(),
    st.complex_numbers(),
)


# -- intervals ----------------------------------------------------------------------


@given(HOSTILE_INTERVALS)
@example("0.2")
@example("5/s")
@example("1/d")
@example("24h")
@example("1ms")
@example(0.001)
@example(86_400)
def test_parse_interval_returns_microseconds_in_range_or_raises_invalid_interval(value: Any) -> None:
    try:
        us = parse_interval(value)
    except InvalidIntervalError as exc:
        assert isinstance(exc, SiqError) and str(exc)
        return
    assert type(us) is int and MIN_INTERVAL_US <= us <= MAX_INTERVAL_US
    assert parse_interval(us / 1e6) == us  # the form SiqState passes it on in
    assert parse_duration(value) == us  # a valid interval is a valid duration, the same one


@given(HOSTILE_INTERVALS)
@example("0")
@example("0.5us")
@example(timedelta(0))
@example(-0.0)
@example("1e303")
def test_parse_duration_returns_non_negative_microseconds_or_raises_invalid_interval(value: Any) -> None:
    try:
        us = parse_duration(value)
    except InvalidIntervalError as exc:
        assert isinstance(exc, SiqError) and str(exc)
        return
    assert type(us) is int and us >= 0


@given(st.integers(min_value=MIN_INTERVAL_US, max_value=MAX_INTERVAL_US))
@example(MIN_INTERVAL_US)
@example(MAX_INTERVAL_US)
@example(1_500)
@example(999_999)
@example(90_000_000)
def test_format_interval_output_parses_back_to_nearly_the_same_interval(us: int) -> None:
    text = format_interval(us)
    assert parse_interval(text) == pytest.approx(us, rel=5e-6)


@given(st.integers(min_value=MIN_INTERVAL_US, max_value=MAX_INTERVAL_US))
@example(1_000_001)  # "1s"
@example(12_345_678)  # "12.3457s"
def test_format_interval_round_trips_exactly(us: int) -> None:
    # format_interval is what error messages tell users to type back (IntervalMismatchError:
    # "set_interval('12.3457s')"), and what `siq set-interval` echoes: it must be exact.
    assert parse_interval(format_interval(us)) == us


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (parse_interval, 10**400),
        (parse_interval, -(10**400)),
        (parse_interval, 1e303),
        (parse_interval, "0." + "0" * 300 + "1/d"),  # a rate of almost nothing: 1e301 days
        (parse_duration, 10**400),
        (parse_duration, 1e303),
    ],
    ids=["int-1e400", "int--1e400", "float-1e303", "rate-1e-301/d", "duration-int-1e400", "duration-float-1e303"],
)
def test_huge_numbers_are_invalid_not_overflow(parse: Any, value: object) -> None:
    with pytest.raises(InvalidIntervalError):
        parse(value)


# -- queue names --------------------------------------------------------------------

QUEUE_NAMES = st.one_of(
    st.text(max_size=30),
    st.text(min_size=195, max_size=205),
    st.text(alphabet="ab{}*?[]\\ \t\n\x00\x7f\x85\u2028:.-_ü", max_size=8),
    st.sampled_from(["geo", "a:b", "}:state", ":{x", "x" * 200, "x" * 201, "ünïcode", "\u200b", "-", "."]),
)


def _redis_hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes (CLUSTER KEYSLOT's rule)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


@settings(deadline=None)  # a fresh SQLite file per example: its first fsync can be slow
@given(QUEUE_NAMES)
def test_queue_names_are_refused_before_anything_is_written_or_make_round_tripping_keys(name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="siq-names-") as tmp:
        url = f"sqlite:///{tmp}/siq.db"
        try:
            queue = IntervalQueue(name, url=url, interval="1s")
        except InvalidQueueNameError as exc:
            assert str(exc)
            if os.path.exists(f"{tmp}/siq.db"):  # nothing written (or not even a file)
                backend = backend_from_url(url)
                assert backend.queues() == []
                backend.close()
            return
        try:
            keys = QueueKeys.for_queue(name)
            assert QueueKeys.queue_from_state_key(keys.state) == name
            group = re.match(r"\{([^{}]+)\}.", name, re.S)  # "{group}rest" names its own hash tag
            every = (*keys.all, *keys.fair_keys, keys.fair_line("a key"))  # one cluster slot
            assert {_redis_hash_tag(key) for key in every} == {group[1] if group else name}
            queue.ensure()
            assert queue.backend.queues() == [name]
            assert queue.status().queue == name
        finally:
            queue.close()


@pytest.mark.parametrize("name", ["a\udcff", "\ud800"])
def test_queue_names_that_are_not_unicode_text_are_refused(name: str, tmp_path: Path) -> None:
    # What `siq pause $'a\xff'` passes on (argv decodes with surrogateescape), or a JSON
    # "\ud800" escape: accepted by validate_queue_name, then UnicodeEncodeError in the store.
    url = f"sqlite:///{tmp_path}/siq.db"
    try:
        IntervalQueue(name, url=url, interval="1s").ensure()
    except InvalidQueueNameError:
        return
    pytest.fail("accepted")


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?socket_timeout=abc",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:99999/0",
        "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus",
        "redis+sentinel://127.0.0.1:1/mymaster/notadb",
        "sqlite:///%00.db",
    ],
)
def test_malformed_store_urls_are_configuration_errors(url: str) -> None:
    # None of these reaches a server: each fails while the URL is read, with redis-py's or
    # sqlite3's own ValueError (or RedisError), not a ConfigurationError naming the URL.
    with pytest.raises(ConfigurationError):
        IntervalQueue("q", url=url, interval="1s").ensure()


# -- the siq command ----------------------------------------------------------------

_COMMANDS = ("status", "pause", "resume", "set-interval", "reset", "export")
_SAFE_DASHED = ["-", "--", "-h", "--help", "--yes", "--json", "--parked", "--bogus", "-x", "--grace", "--since"]
# Free text never starts with "-": "-o/etc/x" would be `--out /etc/x` (the tests may run as root).
_FREE = st.text(max_size=15).filter(lambda t: not t.startswith("-"))
_QUEUE_ARGS = st.one_of(
    st.sampled_from(["geo", "held", "nope", "*", "g*", "h?ld", "[gh]*", "", "a b", "{x}", "x" * 201]), _FREE
)
_VALUES = st.one_of(
    _FREE,
    INTERVAL_TEXT.filter(lambda t: not t.startswith("-")),
    st.sampled_from(["2h", "7d", "2026-11-21T08:00", "2026-11-21T08:00+02:00", "1795250000", "0", "-1", "1e9"]),
    st.sampled_from(["nan", "inf", "1e400", "1e20", "9" * 30 + "d", "2026-13-01", "10**9", "1e12", "1e13"]),
    st.floats().map(str),
    st.integers().map(str),
)


@st.composite
def cli_calls(draw: st.DrawFn, workdir: str) -> tuple[list[str], str | None, bool]:
    """``(argv after --url, stdin, has_junk)`` for one siq command."""
    command = draw(st.sampled_from(_COMMANDS))
    args: list[str] = []
    if command == "status":
        args += draw(st.lists(_QUEUE_ARGS, max_size=3))
        args += ["--json"] if draw(st.booleans()) else []
    elif command in ("pause", "resume", "set-interval", "reset"):
        args.append(draw(_QUEUE_ARGS))
        if command == "resume" and draw(st.booleans()):
            args += ["--grace", draw(_VALUES)]
        if command == "set-interval":
            args.append(draw(_VALUES))
        if command == "reset":
            args += ["--yes"] if draw(st.booleans()) else []
            args += ["--interval", draw(_VALUES)] if draw(st.booleans()) else []
    else:
        args += draw(st.lists(_QUEUE_ARGS, max_size=2))
        out = draw(st.sampled_from(["-", "ledger.jsonl", "ledger.parquet", "missing/ledger.jsonl", "x.pq"]))
        args += ["--out", out if out == "-" else os.path.join(workdir, out)]
        if draw(st.booleans()):
            args += ["--format", draw(st.one_of(st.sampled_from(["jsonl", "parquet"]), _FREE))]
        for option in ("--since", "--until"):
            if draw(st.booleans()):
                args += [option, draw(_VALUES)]
        args += ["--parked"] if draw(st.integers(0, 3)) == 0 else []
    if draw(st.integers(0, 4)) == 0:  # a required argument missing
        args = args[: draw(st.integers(0, len(args)))]
    junk = draw(st.lists(st.one_of(st.sampled_from(_SAFE_DASHED), _FREE), max_size=2)) if draw(st.booleans()) else []
    stdin = draw(st.sampled_from([None, "", "y\n", "n\n", "maybe\n"]))
    return [command, *args, *junk], stdin, bool(junk)


def _seed(url: str) -> None:
    """A store with a running queue (claims, a ledger row, a parked task) and a paused one."""
    clock = PinnedClock()
    backend = backend_from_url(url, clock=clock)
    for name in backend.queues():
        backend.delete(name)
    geo = IntervalQueue(
        "geo", backend=backend, interval="200ms", sleep=clock.advance, monotonic=lambda: clock.now_us / 1e6
    )
    geo.ensure()
    with geo.slot(name="seeded"):
        pass
    tickets = geo.claim_many(2)
    backend.park("geo", tickets[0].epoch, [ParkedTask(tickets[1].number, "t-2", parked_message("t", [2], {}, {}))])
    held = IntervalQueue("held", backend=backend, interval="1s")
    held.ensure()
    held.pause()
    backend.close()


_SEEDED: dict[str, dict[str, Any]] = {}


def _snapshot(url: str) -> dict[str, Any]:
    """Everything a command could change: each queue's state, parked tasks and ledger."""
    backend = _READERS.get(url) or _READERS.setdefault(url, backend_from_url(url))
    out = {}
    for name in backend.queues():
        status = backend.status(name)
        assert status is not None
        parked, ledger = backend.parked_tasks(name), list(backend.ledger(name))
        out[name] = (status.state, status.finished, status.parked, parked, ledger)
    return out


_READERS: dict[str, Backend] = {}


@pytest.fixture(scope="module", params=["memory", "sqlite"])
def cli_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    workdir = tmp_path_factory.mktemp(f"cli-{request.param}")
    (workdir / "x.pq").mkdir()  # an --out that is a folder
    url = f"memory://cli-{os.getpid()}-{next(_counter)}" if request.param == "memory" else f"sqlite:///{workdir}/siq.db"
    yield url, str(workdir)
    reader = _READERS.pop(url, None)
    if reader is not None:
        reader.close()


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_any_command_line_exits_0_1_or_2_and_a_refused_one_changes_nothing(
    cli_store: tuple[str, str], data: st.DataObject
) -> None:
    url, workdir = cli_store
    argv, stdin, has_junk = data.draw(cli_calls(workdir))
    before = _snapshot(url)
    if before != _SEEDED.get(url):  # the last example changed the store (or this is the first)
        _seed(url)
        before = _SEEDED[url] = _snapshot(url)
    with contextlib.chdir(workdir):  # anything relative lands in the test's own folder
        result = CliRunner().invoke(siq, ["--url", url, *argv], input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), _explain(result)
    assert result.exit_code in (0, 1, 2), _explain(result)
    assert "Traceback" not in result.output
    after = _snapshot(url)
    if result.exit_code != 0:
        assert after == before, f"refused ({result.output.strip()[-200:]!r}) yet the store changed"
    elif not has_junk and "--help" not in argv and "-h" not in argv:
        _check_effect(argv, before, after, result)
    if after != before:  # whatever was accepted leaves a store that `siq status` can still show
        status = CliRunner().invoke(siq, ["--url", url, "status", "--json"])
        assert status.exit_code == 0, _explain(status)
        assert {q["queue"] for q in json.loads(status.output)} == set(after)


def _check_effect(argv: list[str], before: dict[str, Any], after: dict[str, Any], result: Result) -> None:
    command, *args = argv
    if command == "status":
        assert after == before
        if "--json" in args:
            json.loads(result.output)
    elif command in ("pause", "resume", "set-interval"):
        state: QueueState = after[args[0]][0]
        if command == "pause":
            assert state.paused
        elif command == "resume":
            assert not state.paused
        else:
            assert state.interval_us == parse_interval(args[1])
    elif command == "reset":
        assert after[args[0]][0].epoch != before[args[0]][0].epoch
    else:
        assert after == before


def _explain(result: Result) -> str:
    return f"exit {result.exit_code}, {result.exception!r}, output {result.output[-300:]!r}"


def _invoke(url: str, *argv: str) -> Result:
    return CliRunner().invoke(siq, ["--url", url, *argv])


def test_cli_queue_name_from_undecodable_argv(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/siq.db"
    result = _invoke(url, "pause", "a\udcff")  # `siq pause $'a\xff'`
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, _explain(result)


@pytest.mark.parametrize("since", ["nan", "inf", "1e400", "1e20", "9" * 400 + "d"])
def test_export_times_beyond_range_are_one_line_errors(since: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/siq.db"
    IntervalQueue("geo", url=url, interval="1s").ensure()
    result = _invoke(url, "export", "--since", since, "--out", "-")
    assert result.exception is None or isinstance(result.exception, SystemExit), _explain(result)


@pytest.mark.parametrize("grace", ["1e12", "1e13"])
def test_resume_with_a_huge_grace_is_refused_or_status_still_works(grace: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/siq.db"
    IntervalQueue("geo", url=url, interval="1s").ensure()
    assert _invoke(url, "pause", "geo").exit_code == 0
    result = _invoke(url, "resume", "geo", "--grace", grace)  # 31,700 years
    assert result.exception is None or isinstance(result.exception, SystemExit), _explain(result)
    status = _invoke(url, "status")
    assert status.exit_code == 0, _explain(status)


@pytest.mark.parametrize("out", ["{tmp}", "{tmp}/", ""])
def test_export_to_a_folder_is_a_one_line_error(out: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/siq.db"
    IntervalQueue("geo", url=url, interval="1s").ensure()
    with contextlib.chdir(tmp_path):
        result = _invoke(url, "export", "--out", out.format(tmp=tmp_path))
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, _explain(result)


# -- ticket headers -----------------------------------------------------------------

_QUEUE_NAME = st.text(alphabet="abcgeo:._-", min_size=1, max_size=6)


@dataclass(frozen=True)
class Live:
    """A header value taken from the queue's live state when the message is built: the
    ``queue`` name itself, or its ``epoch``, or ``current``/``ticket`` + ``offset``, each
    optionally ``mangled`` (upper case, a space, a trailing newline, one character less)."""

    what: str
    offset: int = 0
    mangled: str = ""

    def value(self, queue: str, state: QueueState) -> Any:
        if self.what in ("current", "ticket"):
            return getattr(state, self.what) + self.offset
        text = queue if self.what == "queue" else state.epoch
        return {"upper": text.upper(), "space": f" {text}", "newline": f"{text}\n", "chop": text[:-1]}.get(
            self.mangled, text
        )


_MANGLED = st.sampled_from(["", "", "upper", "space", "newline", "chop"])
_EPOCH_VALUES = st.one_of(
    st.builds(Live, st.just("epoch"), st.just(0), _MANGLED),
    st.sampled_from(["0", "f" * 64, "f" * 65, "", "0\n", "abc\n", "ABC", "0x1f", "g"]),
    st.text(alphabet="0123456789abcdef", min_size=1, max_size=64).map(lambda e: e + "\n" if len(e) % 5 == 0 else e),
    st.text(max_size=70),
    JSON_SCALARS,
)
_NUMBER_VALUES = st.one_of(
    st.builds(Live, st.sampled_from(["current", "ticket"]), st.integers(-2, 2)),
    st.sampled_from([0, 1, -1, MAX_TICKET - 1, MAX_TICKET, MAX_TICKET + 1, 10**6, 2**63, 10**400]),
    st.integers(),
    st.sampled_from([True, False, 1.0, 2.5, float("nan"), "1", "0x1", "", None, [1], {"n": 1}]),
    JSON_VALUES,
)
_QUEUE_VALUES = st.one_of(
    st.builds(Live, st.just("queue"), st.just(0), _MANGLED), st.sampled_from(["other", ""]), _QUEUE_NAME, JSON_VALUES
)
_WELL_FORMED_HEADERS = st.fixed_dictionaries(
    {
        QUEUE: st.just(Live("queue")),
        TICKET: st.builds(Live, st.sampled_from(["current", "ticket"]), st.integers(-1, 2)),
        EPOCH: st.builds(Live, st.just("epoch"), st.just(0), _MANGLED),
    }
)
_ONE_FIELD_OFF = st.builds(
    lambda headers, key, value: {**headers, key: value},
    _WELL_FORMED_HEADERS,
    st.sampled_from([QUEUE, TICKET, EPOCH]),
    st.one_of(_QUEUE_VALUES, _NUMBER_VALUES, _EPOCH_VALUES),
)
TAMPERED_HEADERS = st.one_of(
    st.none(),
    _WELL_FORMED_HEADERS,
    _ONE_FIELD_OFF,
    st.builds(
        lambda mine, rest: {**rest, **mine},
        st.fixed_dictionaries(
            {}, optional={QUEUE: _QUEUE_VALUES, TICKET: _NUMBER_VALUES, EPOCH: _EPOCH_VALUES, DEFERRALS: JSON_SCALARS}
        ),
        st.dictionaries(st.text(max_size=8), JSON_SCALARS, max_size=2),
    ),
)
"""Message headers as they may arrive: any mix of the ticket headers (the right queue or
not, issued, used, far-ahead or malformed numbers, any epoch) and other headers."""


def resolve(headers: dict[str, Any] | None, queue: str, state: QueueState) -> dict[str, Any] | None:
    if headers is None:
        return None
    return {k: v.value(queue, state) if isinstance(v, Live) else v for k, v in headers.items()}


_INITIAL = QueueState("0123abcd", 100_000, 3, 1, 0, 0, False)


@given(queue=_QUEUE_NAME, headers=TAMPERED_HEADERS)
@example(queue="geo", headers={QUEUE: "geo", TICKET: MAX_TICKET, EPOCH: "f" * 64})
@example(queue="geo", headers={QUEUE: "geo", TICKET: MAX_TICKET + 1, EPOCH: "0"})
@example(queue="geo", headers={QUEUE: "geo", TICKET: True, EPOCH: "0"})
def test_ticket_headers_decode_to_a_ticket_of_the_asked_queue_or_to_none(
    queue: str, headers: dict[str, Any] | None
) -> None:
    headers = resolve(headers, queue, _INITIAL)
    ticket, reason = ticket_from_headers(headers, queue)
    if ticket is not None:
        assert reason is None
        assert ticket.queue == queue == (headers or {}).get(QUEUE)
        assert type(ticket.number) is int and 1 <= ticket.number <= MAX_TICKET
        assert isinstance(ticket.epoch, str) and _HEX.fullmatch(ticket.epoch)
    elif all((headers or {}).get(name) is None for name in (QUEUE, TICKET, EPOCH)):
        assert reason is None  # a message sent by name: nothing to complain about
    else:
        assert isinstance(reason, str) and reason  # a tampered ticket is logged, with why


@pytest.mark.parametrize("epoch", ["0\n", "abc\n"])
def test_an_epoch_with_a_trailing_newline_is_malformed(epoch: str) -> None:
    ticket, _ = ticket_from_headers({QUEUE: "geo", TICKET: 1, EPOCH: epoch}, "geo")
    assert ticket is None, ticket


def _assert_interval_kept(starts: list[int], interval_us: int) -> None:
    gaps = [b - a for a, b in itertools.pairwise(sorted(starts))]
    assert all(gap >= interval_us for gap in gaps), (gaps, interval_us)


@settings(deadline=None)
@given(data=st.data())
def test_tampered_headers_on_a_pinned_clock_start_once_each_and_keep_the_interval(data: st.DataObject) -> None:
    clock = PinnedClock()
    queue = IntervalQueue(
        "geo",
        interval="100ms",
        backend=MemoryBackend(clock=clock),
        sleep=clock.advance,
        monotonic=lambda: clock.now_us / 1e6,  # every round trip takes no time on this clock
    )
    queue.ensure()
    starts: list[int] = []
    for n in range(data.draw(st.integers(1, 4), label="starts")):
        clock.advance(data.draw(st.sampled_from([0.0, 0.0, 0.05, 0.1, 2.0, 3600.0]), label="idle"))
        for _ in range(data.draw(st.integers(0, 2), label="extra claims")):  # issued, never started
            queue.claim()
        state = queue.status().state
        headers = resolve(data.draw(TAMPERED_HEADERS, label="headers"), "geo", state)
        ticket, _ = ticket_from_headers(headers, "geo")
        decision = queue.wait_for_turn(
            ticket, task_id=f"task-{n}", timeout=7 * 86_400, record=StartRecord("t", f"task-{n}")
        )
        assert decision.authorized
        after = queue.status().state
        assert 1 <= decision.ticket <= after.ticket and after.epoch == state.epoch  # only issued tickets start
        starts.append(decision.now_us)
    rows = list(queue.ledger())
    assert sorted(r.start_us for r in rows) == starts  # each start once, in order, and in the ledger
    assert sorted(r.task_id or "" for r in rows) == sorted(f"task-{n}" for n in range(len(starts)))
    _assert_interval_kept(starts, 100_000)


@pytest.fixture(scope="module")
def eager_task() -> Iterator[tuple[Any, list[int]]]:
    from celery import Celery

    app = Celery("hostile", broker="memory://", set_as_current=False)
    app.conf.update(
        siq_url=f"memory://hostile-{os.getpid()}",
        task_eager_propagates=True,
        task_serializer="json",
        accept_content=["json"],
    )
    runs: list[int] = []

    @app.task(base=IntervalTask, shared=False, interval="1ms", interval_queue="hostile")
    def job(n: int) -> int:
        runs.append(n)
        return n

    yield job, runs
    job.siq_queue().delete()


@settings(deadline=None)  # real time: each start waits its (1 ms) slot
@given(data=st.data())
def test_an_eager_task_with_tampered_headers_runs_once_and_keeps_the_interval(
    eager_task: tuple[Any, list[int]], data: st.DataObject
) -> None:
    job, runs = eager_task
    queue = job.siq_queue()
    queue.delete()
    queue.ensure()
    runs.clear()
    count = data.draw(st.integers(1, 3), label="tasks")
    for n in range(count):
        for _ in range(data.draw(st.integers(0, 1), label="extra claims")):
            queue.claim()
        headers = resolve(data.draw(TAMPERED_HEADERS, label="headers"), "hostile", queue.status().state)
        result = job.apply((n,), headers=headers)
        assert result.successful() and result.get() == n
    assert runs == list(range(count))  # each exactly once
    status = queue.status()
    rows = list(queue.ledger())
    assert len(rows) == count and {r.outcome for r in rows} == {"SUCCESS"}
    assert all(1 <= r.ticket <= status.state.ticket and r.epoch == status.state.epoch for r in rows)
    _assert_interval_kept([r.start_us for r in rows], status.state.interval_us)
