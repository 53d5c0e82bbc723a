"""siq_backoff(response): the hold read from Retry-After, RateLimit-Reset or
X-RateLimit-Reset, on a pinned clock; and from real requests, httpx and urllib responses
of a local server."""

from __future__ import annotations

import email.message
import http.server
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
import requests
from celery import Celery

from siq_celery import ConfigurationError, IntervalQueue, IntervalTask
from siq_celery.pytest_plugin import SiqStore
from siq_celery.tasks.app_state import replace_siq_state
from siq_celery.tasks.retry_after import MAX_HOLD_S, hold_from
from siq_celery.testing import PinnedClock

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z: the pinned clock


def clock() -> float:
    return NOW


def hold(headers: dict[str, str], **kwargs: Any) -> object:
    return hold_from(headers, now=clock, **kwargs)


def http_date(unix: float) -> str:
    return format_datetime(datetime.fromtimestamp(unix, UTC), usegmt=True)


# -- what each header says --------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [("120", 120.0), ("0", 0.0), (" 7 ", 7.0), ("1.5", 1.5)])
def test_retry_after_in_delta_seconds(value: str, seconds: float) -> None:
    assert hold({"Retry-After": value}) == seconds


def test_retry_after_as_an_http_date_is_the_time_until_then() -> None:
    assert hold({"Retry-After": http_date(NOW + 90)}) == 90.0
    assert hold({"Retry-After": "Fri, 15 Jan 2027 08:00:30 GMT"}) == 30.0


def test_retry_after_in_the_past_or_a_naive_date_is_read_as_gmt() -> None:
    assert hold({"Retry-After": http_date(NOW - 3600)}) == 0.0  # come back now, not never
    assert hold({"Retry-After": "Fri, 15 Jan 2027 08:01:00 -0000"}) == 60.0  # no zone: GMT


def test_ratelimit_reset_is_delta_seconds() -> None:
    assert hold({"RateLimit-Reset": "42"}) == 42.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("60", 60.0),  # delta-seconds
        (str(int(NOW) + 300), 300.0),  # Unix seconds (GitHub)
        (f"{NOW + 12.25:.3f}", 12.25),  # Unix seconds with a fraction (Discord)
        (str(int(NOW * 1000) + 1500), 1.5),  # Unix milliseconds
        (str(int(NOW) - 5), 0.0),  # a reset already past: come back now
        (str(int(NOW * 1000) - 5000), 0.0),
    ],
)
def test_x_ratelimit_reset_is_a_delay_or_a_unix_time_by_size(value: str, seconds: float) -> None:
    assert hold({"X-RateLimit-Reset": value}) == seconds


def test_the_first_header_present_decides() -> None:
    every = {"X-RateLimit-Reset": "3", "RateLimit-Reset": "2", "Retry-After": "1"}
    assert hold(every) == 1.0
    assert hold({"X-RateLimit-Reset": "3", "RateLimit-Reset": "2"}) == 2.0
    assert hold({"X-RateLimit-Reset": "3", "Content-Type": "text/plain"}) == 3.0


def test_an_unreadable_first_header_is_an_error_not_skipped() -> None:
    with pytest.raises(ConfigurationError, match="Retry-After"):
        hold({"Retry-After": "soon", "RateLimit-Reset": "2"})


@pytest.mark.parametrize("name", ["retry-after", "RETRY-AFTER", "rEtRy-AfTeR"])
def test_header_names_are_matched_in_any_case_even_in_a_plain_dict(name: str) -> None:
    assert hold({name: "5"}) == 5.0
    assert hold({"x-ratelimit-reset": "4"}) == 4.0


def test_a_repeated_header_reads_its_first_value() -> None:
    headers = email.message.Message()  # what http.client and urllib keep headers in
    headers["retry-after"] = "5"
    headers["Retry-After"] = "9"
    assert hold_from(headers, now=clock) == 5.0


# -- what is refused ----------------------------------------------------------------------

NOT_A_DELTA_OR_DATE = "neither delta-seconds nor an HTTP-date"
NEGATIVE = "is negative"
NOT_SECONDS = "not a number of seconds"


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("Retry-After", "soon", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "nan", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "inf", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "1e3", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "5, 5", NOT_A_DELTA_OR_DATE),
        ("Retry-After", "-5", NEGATIVE),
        ("RateLimit-Reset", "-1", NEGATIVE),
        ("RateLimit-Reset", "soon", NOT_SECONDS),
        ("RateLimit-Reset", "NaN", NOT_SECONDS),
        ("X-RateLimit-Reset", "1_000", NOT_SECONDS),
        ("X-RateLimit-Reset", "-1700000000", NEGATIVE),
    ],
)
def test_an_unreadable_value_is_one_line_naming_the_header_and_value(name: str, value: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=why) as refused:
        hold({name: value})
    message = str(refused.value)
    assert f"{name}: {value!r}" in message and "\n" not in message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Retry-After", "86401"),  # one second over a day
        ("Retry-After", "315360000"),  # ten years
        ("Retry-After", "9" * 400),  # beyond any float
        ("Retry-After", http_date(NOW + 2 * 86_400)),
        ("Retry-After", "Fri, 15 Jan 9999 08:00:00 GMT"),
        ("RateLimit-Reset", "1800000000"),  # a Unix time where the draft says delta-seconds
        ("X-RateLimit-Reset", "999999999"),  # 31 years of delay
        ("X-RateLimit-Reset", str(int(NOW) + 86_401)),
        ("X-RateLimit-Reset", "99999999999999999"),  # milliseconds, in the year 5138
    ],
)
def test_a_hold_over_a_day_is_refused_not_held_for_years(name: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match="over one day") as refused:
        hold({name: value})
    assert name in str(refused.value) and "\n" not in str(refused.value)


def test_a_day_exactly_is_the_cap() -> None:
    assert hold({"Retry-After": "86400"}) == MAX_HOLD_S == 86_400.0


def test_a_long_garbage_value_is_cut_in_the_message() -> None:
    with pytest.raises(ConfigurationError) as refused:
        hold({"Retry-After": "<html>" + "x" * 500})
    assert len(str(refused.value)) < 250


def test_none_of_the_headers_is_an_error_unless_a_default_is_given() -> None:
    with pytest.raises(ConfigurationError, match="none of the headers Retry-After, RateLimit-Reset"):
        hold({"Content-Type": "text/plain"})
    assert hold({"Content-Type": "text/plain"}, default=30) == 30
    assert hold({"Retry-After": "5"}, default=30) == 5.0  # the header wins over the default


@pytest.mark.parametrize("seconds", [30, 1.5, "30s", timedelta(minutes=1), 0, -1, "fast", 10**9])
def test_seconds_pass_through_unchanged_for_the_queue_to_validate_as_before(seconds: object) -> None:
    assert hold_from(seconds, now=clock) is seconds  # type: ignore[arg-type]


def test_something_else_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="a response or its headers, not None"):
        hold_from(None)  # type: ignore[arg-type]


def test_the_real_clock_is_the_default() -> None:
    import time

    assert 50 < hold_from({"X-RateLimit-Reset": str(int(time.time()) + 60)}) <= 60  # type: ignore[operator]


# -- siq_backoff takes it -------------------------------------------------------------------


@pytest.fixture
def task(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[object]]:
    """An IntervalTask whose back-off records the hold it was given (no worker, no store)."""
    held: list[object] = []
    monkeypatch.setattr("siq_celery.tasks.task.back_off", lambda task, seconds: held.append(seconds))
    app = Celery("retry_after", broker="memory://", set_as_current=False)
    app.conf.siq_url = "memory://retry-after"

    @app.task(base=IntervalTask, interval="100ms", interval_queue="api", bind=True, shared=False)
    def call(self: Any) -> None: ...

    return call, held


def test_siq_backoff_reads_a_response_and_keeps_taking_seconds(task: tuple[Any, list[object]]) -> None:
    call, held = task
    call.siq_backoff({"retry-after": "12"})
    call.siq_backoff(2.5)
    call.siq_backoff("30s")
    call.siq_backoff({"Content-Type": "text/plain"}, default=7)
    assert held == [12.0, 2.5, "30s", 7]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """siq_celery's warnings so far (the test sets their level on its logger first)."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "siq_celery"]


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"Content-Type": "text/plain"}, "none of the headers Retry-After, RateLimit-Reset, X-RateLimit-Reset"),
        ({"Retry-After": "later"}, "Retry-After: 'later' is neither delta-seconds nor an HTTP-date"),
        ({"X-RateLimit-Reset": "99999999999999999"}, "X-RateLimit-Reset: '99999999999999999': a hold of"),
    ],
)
def test_siq_backoff_holds_siq_backoff_default_for_a_response_it_cannot_read(
    task: tuple[Any, list[object]], caplog: pytest.LogCaptureFixture, headers: dict[str, str], named: str
) -> None:
    """A 429 is the one moment the task must not fail: no header, or one that cannot be
    read, holds the queue for siq_backoff_default (60 s), with one warning naming it."""
    caplog.set_level(logging.WARNING, logger="siq_celery")  # whatever level an earlier worker left on the root
    call, held = task
    call.siq_backoff(headers)
    assert held == [60.0]
    (warning,) = warnings_of(caplog)
    print(warning)
    assert named in warning and "held for 60.0s instead (siq_backoff_default)" in warning and "\n" not in warning
    call.app.conf.siq_backoff_default = 5
    replace_siq_state(call.app, None)  # settings are read once per app
    call.siq_backoff(headers)
    assert held == [60.0, 5.0]


def test_default_wins_over_siq_backoff_default_and_warns_only_of_an_unreadable_header(
    task: tuple[Any, list[object]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="siq_celery")
    call, held = task
    call.siq_backoff({"Content-Type": "text/plain"}, default=7)  # no header, as the caller foresaw
    assert warnings_of(caplog) == []
    call.siq_backoff({"Retry-After": "later"}, default=7)
    assert held == [7, 7]
    (warning,) = warnings_of(caplog)
    assert "Retry-After: 'later'" in warning and "held for 7s instead (default=)" in warning


def test_what_is_neither_seconds_nor_a_response_is_still_refused(task: tuple[Any, list[object]]) -> None:
    call, held = task
    with pytest.raises(ConfigurationError, match="a response or its headers, not None"):
        call.siq_backoff(None)
    assert held == []


def test_a_read_hold_holds_a_queue() -> None:
    queue = IntervalQueue("api", url="memory://", interval="100ms")
    queue.ensure()
    queue.backoff(hold_from({"Retry-After": "2"}, now=clock))
    assert 1_900_000 < queue.start(queue.claim()).wait_us <= 2_100_000


# -- real responses of a local server -------------------------------------------------------

#: Path -> headers of the 429 the server answers with.
ANSWERS = {
    "/seconds": {"Retry-After": "120"},
    "/date": {"Retry-After": http_date(NOW + 45)},
    "/draft": {"RateLimit-Reset": "17"},
    "/epoch": {"x-ratelimit-reset": str(int(NOW * 1000) + 3000)},
    "/several": {"X-RateLimit-Reset": "3", "ratelimit-reset": "2", "retry-after": "1"},
    "/none": {},
    "/garbage": {"Retry-After": "later"},
}
EXPECTED = {"/seconds": 120.0, "/date": 45.0, "/draft": 17.0, "/epoch": 3.0, "/several": 1.0}


class TooMany(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(429)
        for name, value in ANSWERS[self.path].items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:  # keep the test output quiet
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TooMany)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_a_requests_response(server: str, path: str) -> None:
    with requests.get(server + path, timeout=5) as response:
        assert response.status_code == 429
        assert hold_from(response, now=clock) == EXPECTED[path]


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_an_httpx_response_and_its_headers(server: str, path: str) -> None:
    response = httpx.get(server + path, timeout=5)
    assert response.status_code == 429
    assert hold_from(response, now=clock) == hold_from(response.headers, now=clock) == EXPECTED[path]


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_a_urllib_http_error(server: str, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(server + path, timeout=5)
    with failed.value:
        assert hold_from(failed.value, now=clock) == EXPECTED[path]


def test_real_responses_with_no_header_or_garbage(server: str) -> None:
    with requests.get(server + "/none", timeout=5) as response:
        with pytest.raises(ConfigurationError, match="Response: it has none of the headers"):
            hold_from(response, now=clock)
        assert hold_from(response, default=10, now=clock) == 10
    with pytest.raises(ConfigurationError, match="Retry-After: 'later'"):
        hold_from(httpx.get(server + "/garbage", timeout=5), now=clock)


# -- a real 429 in a real worker: the task is held, not failed ------------------------------

US = 1_000_000


@pytest.fixture
def celery_app(celery_app: Any, server: str) -> Any:
    """Celery's test app with an interval task, 1 s apart, that calls the local server and
    backs off from its 429 (once per task)."""
    held: set[str] = set()

    @celery_app.task(base=IntervalTask, interval="1s", interval_queue="api", name="api.call", bind=True)
    def call(self: Any, path: str, default: float | None = None) -> str:
        with requests.get(server + path, timeout=5) as response:
            if response.status_code == 429 and self.request.id not in held:
                held.add(self.request.id)
                self.siq_backoff(response, default=default)
        return "done"

    celery_app.conf.result_backend = "rpc://"
    return celery_app


@pytest.mark.parametrize(
    ("path", "default", "hold"),
    [
        ("/none", None, 60),  # siq_backoff_default's own
        ("/garbage", None, 60),
        ("/garbage", 7, 7),  # default= wins
    ],
)
def test_a_429_the_task_cannot_read_holds_the_queue_in_a_worker_and_the_task_runs_after(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any, caplog: pytest.LogCaptureFixture,
    path: str, default: int | None, hold: int,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="siq_celery")  # the worker sets the root logger's level to ERROR
    start = siq_clock.now_us
    assert celery_app.tasks["api.call"].delay(path, default).get(timeout=10) == "done"
    starts = [(row.start_us - start, row.outcome) for row in siq_store.starts("api")]
    assert starts == [(1 * US, "BACKOFF"), ((1 + hold) * US, "SUCCESS")]
    (warning,) = warnings_of(caplog)
    assert f"held for {hold if default else float(hold)}s instead" in warning


@pytest.mark.celery(siq_backoff_default=5)
def test_siq_backoff_default_is_the_hold_of_a_429_with_no_header(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    start = siq_clock.now_us
    assert celery_app.tasks["api.call"].delay("/none").get(timeout=10) == "done"
    starts = [(row.start_us - start, row.outcome) for row in siq_store.starts("api")]
    assert starts == [(1 * US, "BACKOFF"), (6 * US, "SUCCESS")]
