"""Bad input gets a clear SiqError and changes nothing."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from siq_celery import (
    ConfigurationError,
    IntervalQueue,
    InvalidIntervalError,
    InvalidQueueNameError,
    SiqError,
    UnknownBackendError,
    format_interval,
    parse_interval,
)
from siq_celery.backends import backend_from_url
from siq_celery.keys import QueueKeys


@pytest.mark.parametrize(
    ("text", "us"),
    [
        (0.2, 200_000),
        (2, 2_000_000),
        (timedelta(milliseconds=250), 250_000),
        ("200ms", 200_000),
        ("2s", 2_000_000),
        ("1.5m", 90_000_000),
        ("1h", 3_600_000_000),
        ("2500us", 2_500),
        (" 10 ms ", 10_000),
        ("0.5", 500_000),
        ("5/s", 200_000),
        ("300/m", 200_000),
        ("1000/h", 3_600_000),
        ("1/d", 86_400_000_000),
        ("1d", 86_400_000_000),
        ("0.5d", 43_200_000_000),
        ("2/100ms", 50_000),
        ("10/2s", 200_000),
    ],
)
def test_intervals_and_rates_parse_to_microseconds(text: object, us: int) -> None:
    assert parse_interval(text) == us  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [0, -1, "0ms", "-5ms", math.nan, math.inf, -math.inf, "nan", "inf", "25h", 86_401, "2 days",
     "fast", "", "5/", "/s", "0/s", "5/y", "ms", None, [1], True, "0.5us", "2000/s"],
)  # fmt: skip
def test_bad_intervals_are_refused_with_a_message_that_says_what_works(bad: object) -> None:
    with pytest.raises(InvalidIntervalError) as info:
        parse_interval(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, SiqError)
    assert str(info.value)


@given(st.text(max_size=20))
def test_any_text_either_parses_in_range_or_raises_invalid_interval(text: str) -> None:
    try:
        us = parse_interval(text)
    except InvalidIntervalError:
        return
    assert 1_000 <= us <= 86_400_000_000


@pytest.mark.parametrize("us", [1_000, 2_000, 2_500, 200_000, 2_000_000, 90_000_000, 3_600_000_000])
def test_format_interval_round_trips(us: int) -> None:
    assert parse_interval(format_interval(us)) == us


@pytest.mark.parametrize(
    "name",
    ["", "a{b", "a}b", "with space", "tab\there", "new\nline", "nul\x00", "bell\x07", "star*", "q?", "[x]",
     "x" * 201, 42, None],
)  # fmt: skip
def test_bad_queue_names_are_refused_before_anything_is_written(name: object, tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/siq.db"
    with pytest.raises(InvalidQueueNameError):
        IntervalQueue(name, url=url, interval="1s")  # type: ignore[arg-type]
    assert backend_from_url(url).queues() == []


@pytest.mark.parametrize("name", ["geocoder", "shopify:shop-1", "a.b_c-d", "ünïcode", "x" * 200])
def test_good_queue_names_make_hash_tagged_keys(name: str) -> None:
    keys = QueueKeys.for_queue(name)
    assert keys.state == f"siq:{{{name}}}:state" and keys.finished == f"siq:{{{name}}}:finished"
    assert QueueKeys.queue_from_state_key(keys.state) == name


@pytest.mark.parametrize("url", ["mysql://localhost/db", "http://x", "nourl", "", "memcached://h:1"])
def test_unknown_store_urls_name_the_known_schemes(url: str) -> None:
    with pytest.raises(UnknownBackendError, match="redis"):
        IntervalQueue("q", url=url, interval="1s")


def test_a_queue_without_a_store_says_what_to_pass() -> None:
    with pytest.raises(ConfigurationError, match="redis://"):
        IntervalQueue("q", interval="1s")


@pytest.mark.parametrize("count", [0, -1, 100_001, 1.5, "3", True])
def test_claim_many_refuses_bad_counts_without_claiming(count: object) -> None:
    q = IntervalQueue("q", url="memory://bad-counts", interval="1s")
    q.ensure()
    with pytest.raises(ConfigurationError):
        q.claim_many(count)  # type: ignore[arg-type]
    assert q.status().state.ticket == 0


def test_a_sqlite_path_whose_folder_is_missing_hints_at_the_four_slashes_of_an_absolute_path(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite:///tmp/x/siq.db`` is the relative path ``tmp/x/siq.db``: when its folder does
    not exist, the error says how an absolute path is written."""
    from siq_celery import StoreUnavailableError

    monkeypatch.chdir(str(tmp_path))
    q = IntervalQueue("q", url="sqlite:///var/siq-missing/siq.db", interval="1s")
    with pytest.raises(StoreUnavailableError) as failed:
        q.ensure()
    message = str(failed.value)
    print(message)
    assert "sqlite:////var/siq-missing/siq.db" in message and "four slashes" in message
    assert "\n" not in message


def test_sqlite_url_with_a_host_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="sqlite:///"):
        backend_from_url("sqlite://host/path.db")


@pytest.mark.parametrize("url", ["redis+cluster://nohostport", "redis+sentinel://127.0.0.1:26379"])
def test_malformed_redis_urls_are_refused(url: str) -> None:
    from siq_celery.backends.redis import redis_client_from_url

    with pytest.raises(ConfigurationError):
        redis_client_from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/abc",
        "rediss://127.0.0.1:6380/db1",
        "redis://127.0.0.1:6379/0?db=abc",
        "unix:///tmp/redis.sock?db=one",
        "redis+cluster://127.0.0.1:7000/abc",
        "redis+sentinel://127.0.0.1:26379/mymaster/abc",
    ],
)
def test_a_redis_database_that_is_not_a_number_is_refused_not_read_as_0(url: str) -> None:
    with pytest.raises(ConfigurationError, match="database") as refused:
        backend_from_url(url)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigurationError, match="database"):
        IntervalQueue("q", url=url, interval="1s")


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/3", "redis://h/0?db=2",
     "unix:///tmp/redis.sock?db=1", "redis+cluster://127.0.0.1:7000", "redis+cluster://127.0.0.1:7000/0"],
)  # fmt: skip
def test_a_redis_url_with_a_numbered_database_or_none_is_accepted(url: str) -> None:
    backend_from_url(url)  # connects on first use


def test_a_redis_cluster_url_naming_another_database_than_0_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="only database 0"):
        backend_from_url("redis+cluster://127.0.0.1:7000/2")


@pytest.mark.parametrize(
    ("key", "value"),
    [("siq_metrics_port", "9808"), ("siq_metrics_port", 0), ("siq_metrics_port", 70_000), ("siq_metrics_port", True),
     ("siq_metrics_queues", []), ("siq_metrics_queues", [""]), ("siq_metrics_queues", 3)],
)  # fmt: skip
def test_bad_metrics_settings_name_the_setting(key: str, value: object) -> None:
    from celery import Celery

    from siq_celery.tasks.settings import SiqSettings

    app = Celery("bad-metrics", set_as_current=False)
    app.conf.update(siq_url="memory://bad-metrics", **{key: value})
    with pytest.raises(ConfigurationError, match=key):
        SiqSettings.from_app(app)
    app.conf.update(siq_metrics_port=9808, siq_metrics_queues="shop:*")
    settings = SiqSettings.from_app(app)
    assert settings.metrics_port == 9808 and settings.metrics_queues == ("shop:*",)


def test_every_interval_the_docs_and_the_parse_error_suggest_is_accepted() -> None:
    """The list of forms in docs/queue.md and the parse error's examples are intervals the
    code takes (they once suggested "250us", below the 1 ms floor)."""
    import re
    from pathlib import Path

    from siq_celery.errors import InvalidIntervalError
    from siq_celery.intervals import parse_interval

    with pytest.raises(InvalidIntervalError) as refused:
        parse_interval("fast")
    suggested = re.findall(r"'([^']+)'", str(refused.value))[1:]
    page = Path(__file__).resolve().parent.parent.joinpath("docs", "queue.md").read_text()
    paragraph = page[page.index("The interval can be float seconds") :].split("\n\n")[0]
    listed = re.findall(r'`"([^"]+)"`', paragraph)
    assert len(suggested) >= 6 and len(listed) >= 8
    for form in suggested + listed:
        assert parse_interval(form) >= 1000, form
    with pytest.raises(InvalidIntervalError, match="1 ms"):
        parse_interval("250us")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("-5s", "must be positive"),
        (-2, "must be positive"),
        ("0ms", "must be positive"),
        ("1/0s", "the period must be positive"),
        ("0/s", "count must be positive"),
        ("2d", "longer than the maximum of one day"),
        ("0.5ms", "below the minimum of 1 ms"),
    ],
)
def test_each_refused_interval_says_why(bad: object, message: str) -> None:
    with pytest.raises(InvalidIntervalError, match=message):
        parse_interval(bad)  # type: ignore[arg-type]


def test_a_back_off_that_cannot_be_read_suggests_durations_not_rates() -> None:
    from siq_celery.intervals import parse_duration

    with pytest.raises(InvalidIntervalError) as refused:
        parse_duration("fast")
    assert "/" not in str(refused.value) and "'30s'" in str(refused.value)
    with pytest.raises(InvalidIntervalError, match="negative"):
        parse_duration("-1s")
    assert parse_duration("1d") == 86_400_000_000


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"siq_store_replicas": -1}, "siq_store_replicas"),
        ({"siq_store_replicas": 17}, "siq_store_replicas"),
        ({"siq_store_replicas": "1"}, "siq_store_replicas"),
        ({"siq_store_replicas": 1, "siq_url": "sqlite:///x.db"}, "a Redis store's"),
        ({"siq_store_replicas": 1, "siq_url": "redis+cluster://127.0.0.1:1"}, "not on a Redis Cluster"),
        ({"siq_store_replicas": 2, "siq_url": "rediss+cluster://127.0.0.1:1"}, "not on a Redis Cluster"),
        ({"siq_store_replica_timeout": 0}, "siq_store_replica_timeout"),
    ],
)
def test_bad_replica_settings_name_the_setting(conf: dict[str, object], message: str) -> None:
    from celery import Celery

    from siq_celery.tasks.app_state import siq_state

    app = Celery("bad", broker="memory://", set_as_current=False)
    app.conf.update({"siq_url": "redis://127.0.0.1:1/0", **conf})
    with pytest.raises(ConfigurationError, match=message):
        siq_state(app).backend  # noqa: B018
