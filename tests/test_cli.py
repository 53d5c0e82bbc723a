"""The ``siq`` command on a real SQLite store and a real (private) Redis."""

from __future__ import annotations

import getpass
import json
import re
import time

import pytest
from click.testing import CliRunner

from siq_celery import IntervalQueue
from siq_celery.cli import siq
from siq_celery.embedded import free_port
from siq_celery.parked import FairTask, ParkedTask
from tests.cli_runner import separate_runner


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"sqlite:///{tmp_path}/siq.db"


def run(url: str, *args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(siq, ["--url", url, *args], input=input)
    return result.exit_code, result.output


def test_status_lists_queues_as_a_table_and_as_json(url: str) -> None:
    geo = IntervalQueue("geo", url=url, interval="200ms")
    geo.ensure()
    tickets = geo.claim_many(5)
    geo.backend.park("geo", tickets[0].epoch, [ParkedTask(5, "t5", "{}")])
    IntervalQueue("shop:a", url=url, interval="5/s").ensure()
    code, out = run(url, "status")
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert header.split()[:9] == [
        "queue", "interval", "declared", "override", "ticket", "current", "backlog", "parked", "paused"
    ]  # fmt: skip
    assert rows[0].split()[:9] == ["geo", "200ms", "-", "-", "5", "0", "5", "1", "no"] and rows[1].startswith("shop:a")
    code, out = run(url, "status", "shop:*", "--json")
    assert code == 0 and [q["queue"] for q in json.loads(out)] == ["shop:a"]


def test_pause_resume_set_interval_and_reset_change_the_shared_state(url: str) -> None:
    q = IntervalQueue("geo", url=url, interval="200ms")
    q.ensure()
    assert run(url, "pause", "geo") == (0, "paused geo\n") and q.status().state.paused
    assert run(url, "resume", "geo") == (0, "resumed geo\n") and not q.status().state.paused
    assert run(url, "set-interval", "geo", "250ms") == (0, "geo: interval 250ms (override)\n")
    status = q.status()
    assert status.state.interval_us == 250_000 and status.sources.override_us == 250_000
    assert status.sources.override_by.startswith(f"{getpass.getuser()}@")
    code, out = run(url, "status", "geo")
    assert code == 0 and "250ms by " in out
    assert run(url, "set-interval", "geo", "--clear") == (0, "geo: override cleared, interval 250ms\n")
    assert q.status().sources.override_us == 0  # nothing declared: the interval stays as it was
    q.declare("100ms")
    q.set_interval("250ms")
    assert run(url, "set-interval", "geo", "--clear") == (0, "geo: override cleared, interval 100ms\n")
    for bad in (["set-interval", "geo"], ["set-interval", "geo", "1s", "--clear"]):
        code, out = run(url, *bad)
        assert code == 2 and "INTERVAL, or --clear" in out
    epoch = q.status().state.epoch
    assert run(url, "reset", "geo", input="n\n")[0] == 1 and q.status().state.epoch == epoch  # asked, refused
    assert run(url, "reset", "geo", "--yes")[0] == 0 and q.status().state.epoch != epoch


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["resume", "nope"], "no state"),
        (["status", "nope"], "no state"),
        (["set-interval", "nope", "fast"], "cannot parse interval"),
        (["set-interval", "nope", "0ms"], "minimum"),
        (["reset", "nope", "--yes"], "no state"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(url: str, args: list[str], message: str) -> None:
    code, out = run(url, *args)
    assert code != 0 and message in out and "Traceback" not in out


def test_unreachable_store_is_one_line_and_a_nonzero_exit() -> None:
    code, out = run(f"redis://127.0.0.1:{free_port()}/0", "status")
    assert code == 1 and "cannot reach" in out and "Traceback" not in out


def test_missing_url_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIQ_URL", raising=False)
    result = CliRunner().invoke(siq, ["status"])
    assert result.exit_code == 1 and "SIQ_URL" in result.output


def test_backoff_holds_the_queue_and_refuses_bad_durations(url: str) -> None:
    q = IntervalQueue("api", url=url, interval="100ms")
    q.ensure()
    sent = time.monotonic()
    code, out = run(url, "backoff", "api", "30s")
    assert code == 0 and "api: held, no start before" in out and re.search(r"\(\+(29\.\d|30\.0)", out), out
    wait = q.start(q.claim()).wait
    # the hold runs from when the command ran: however slow this machine, never longer
    assert 30.0 - (time.monotonic() - sent) - 0.01 <= wait <= 30.0
    for bad in ("soon", "-1s", "2d"):
        code, out = run(url, "backoff", "api", bad)
        assert code in (1, 2) and "Error" in out  # 2: click reads "-1s" as an option
    code, out = run(url, "backoff", "nosuch", "1s")
    assert code == 1 and "no state" in out


def test_celery_siq_never_prints_the_brokers_password() -> None:
    from types import SimpleNamespace

    from celery import Celery

    from siq_celery.cli.celery_command import siq as celery_siq

    app = Celery("pw", broker="amqp://alice:s3cretpw@127.0.0.1:5672//", set_as_current=False)
    result = CliRunner().invoke(celery_siq, ["status"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 1 and "is not Redis" in result.output, result.output
    assert "s3cretpw" not in result.output and "alice:***@" in result.output, result.output


@pytest.mark.parametrize(
    "text",
    [
        "amqp://alice:s3cretpw@127.0.0.1:5672//",
        "redis://:s3cretpw@h:6379/0",
        "rediss://bob:s3cretpw:x@h:6380/1",
        "redis+sentinel://u:s3cretpw@h1:26379,h2:26379/mymaster?sentinel_password=s3cretpw",
        "redis://h:6379/0?password=s3cretpw&socket_timeout=2",
        "failed: 'redis://u:s3cretpw@h/0' and amqp://a:s3cretpw@b//",
    ],
)
def test_every_url_in_a_message_loses_its_password(text: str) -> None:
    from siq_celery.errors import redacted

    assert "s3cretpw" not in redacted(text) and "***" in redacted(text)
    assert redacted("redis://h:6379/0 is down") == "redis://h:6379/0 is down"


def test_a_database_the_server_lacks_is_a_one_line_configuration_error(redis_server: object) -> None:
    from siq_celery import ConfigurationError

    url = f"redis://127.0.0.1:{redis_server.port}/99"  # type: ignore[attr-defined]
    code, out = run(url, "status")
    assert code == 1 and out.count("\n") == 1 and "no database" in out and "Traceback" not in out, out
    with pytest.raises(ConfigurationError, match="no database"):
        IntervalQueue("q", url=url, interval="1s").ensure()


def test_a_wrong_password_says_authentication_failed_and_not_the_password(redis_url: str) -> None:
    import redis

    from siq_celery import StoreUnavailableError

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "siqpw", "reset", "on", ">right-one", "~*", "+@all")
    try:
        url = redis_url.replace("redis://", "redis://siqpw:wr0ngpw@")
        code, out = run(url, "status")
        assert code == 1 and "authentication failed" in out and "cannot reach" not in out, out
        assert "wr0ngpw" not in out and out.count("\n") == 1
        with pytest.raises(StoreUnavailableError, match="authentication failed"):
            IntervalQueue("q", url=url, interval="1s").ensure()
    finally:
        admin.execute_command("ACL", "DELUSER", "siqpw")
        admin.close()


@pytest.mark.parametrize(
    "args",
    [["status", "--bogus"], ["nosuch"], ["set-interval"], ["--bogus", "status"], ["backoff", "q"]],
)
def test_usage_errors_are_one_line_on_stderr(args: list[str], tmp_path: object) -> None:
    result = separate_runner().invoke(siq, ["--url", f"sqlite:///{tmp_path}/siq.db", *args])
    assert result.exit_code == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "--help" in result.stderr


def test_celery_siq_usage_errors_are_one_line_too() -> None:
    from types import SimpleNamespace

    from celery import Celery

    from siq_celery.cli.celery_command import siq as celery_siq

    app = Celery("usage", broker="memory://", set_as_current=False)
    app.conf.siq_url = "memory://"
    for args in (["nosuch"], ["set-interval"], ["status", "--bogus"]):
        result = separate_runner().invoke(celery_siq, args, obj=SimpleNamespace(app=app))
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("Error: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["set-interval", "geo", "-5s"], "must be positive"),
        (["set-interval", "geo", "1/0s"], "period must be positive"),
        (["backoff", "geo", "-1s"], "negative"),
        (["backoff", "geo", "fast"], "'30s'"),
    ],
)
def test_negative_and_zero_values_get_the_values_own_error(url: str, args: list[str], message: str) -> None:
    IntervalQueue("geo", url=url, interval="200ms").ensure()
    code, out = run(url, *args)
    assert code != 0 and message in out and "No such option" not in out, out
    assert "/s" not in out or args[0] != "backoff", out  # a back-off is a duration, never a rate


def test_status_shows_the_real_last_start_now_for_a_free_slot_and_utc(url: str) -> None:
    from siq_celery.ledger import StartRecord

    q = IntervalQueue("w", url=url, interval="10ms")
    q.ensure()
    code, out = run(url, "status", "w")
    row = out.strip().splitlines()[1]
    assert code == 0 and row.split()[9] == "-", out  # never started
    time.sleep(0.02)
    assert q.start(q.claim_costs([10])[0], cost=10, record=StartRecord("search", "t1", "h", 1)).authorized
    started = next(iter(q.ledger())).start_us / 1e6
    shown = json.loads(run(url, "status", "w", "--json")[1])[0]
    assert shown["last_start"] == started and shown["held_until"] is None
    code, out = run(url, "status", "w")
    stamp = time.strftime("%H:%M:%S", time.gmtime(started)) + f".{int(started * 1000) % 1000:03d} UTC"
    assert stamp in out.strip().splitlines()[1], (stamp, out)
    time.sleep(0.12)  # past the 10 slots: the queue is free
    code, out = run(url, "status", "w")
    assert out.strip().splitlines()[1].rstrip().endswith(" now"), out
    assert "UTC" in out, out


def test_status_shows_what_binds_beyond_the_interval_only_where_a_queue_has_it(url: str) -> None:
    from siq_celery import Limit

    IntervalQueue("plain", url=url, interval="1s").ensure()
    code, out = run(url, "status")
    assert code == 0 and "limits" not in out.splitlines()[0], out
    q = IntervalQueue("geo", url=url, interval="10ms", quota="5/1s", burst=2)
    q.ensure()
    for _ in range(3):
        with q.slot():
            pass
    IntervalQueue("day", url=url, interval=Limit(quota="10000/d")).ensure()
    code, out = run(url, "status")
    rows = {line.split()[0]: line for line in out.strip().splitlines()}
    print(out)
    assert code == 0 and "limits" in rows["queue"]
    assert "3/5 in 1s, burst 2" in rows["geo"]
    assert rows["day"].split()[1:4] == ["none", "0/10000", "in"]  # a quota alone: no spacing
    assert rows["plain"].split()[1:3] == ["1s", "-"]


def test_status_shows_who_waits_most_in_a_fair_queues_lines(url: str) -> None:
    from siq_celery.backends import backend_from_url

    backend = backend_from_url(url)
    for key, n, weight in (("A", 1200, 1), ("gold", 12, 2), ("b", 12, 1), ("c", 3, 1), ("d", 2, 5), ("e", 1, 1)):
        backend.fair_park("geo", key, weight, [FairTask(f"{key}{i}", "{}") for i in range(n)], 200_000, "e1")
    backend.fair_park("one", "k", 1, [FairTask("k0", "{}")], 200_000, "e1")
    IntervalQueue("plain", url=url, interval="1s").ensure()
    code, out = run(url, "status")
    print(out)
    lines = out.strip().splitlines()
    assert code == 0 and [line.split()[0] for line in lines[1:4]] == ["geo", "one", "plain"]  # the table first
    assert lines[4:] == [
        "geo: fair shares: 6 keys waiting, 1,230 tasks; most waiting: A 1,200 (weight 1), b 12 (weight 1), "
        "gold 12 (weight 2), c 3 (weight 1), d 2 (weight 5), ...",
        "one: fair shares: 1 key waiting, 1 task; most waiting: k 1 (weight 1)",
    ]
    code, out = run(url, "status", "--json")
    shown = {q["queue"]: q for q in json.loads(out)}
    assert code == 0 and (shown["geo"]["fair_keys_waiting"], shown["geo"]["fair_tasks_waiting"]) == (6, 1230)
    assert shown["geo"]["parked"] == 1230  # waiting without a ticket: parked, as a parked task is
    assert [(k["key"], k["waiting"], k["weight"]) for k in shown["geo"]["fair_most_waiting"]] == [
        ("A", 1200, 1), ("b", 12, 1), ("gold", 12, 2), ("c", 3, 1), ("d", 2, 5)
    ]  # fmt: skip
    plain = shown["plain"]
    assert (plain["fair_keys_waiting"], plain["fair_tasks_waiting"], plain["fair_most_waiting"]) == (0, 0, [])
    backend.close()


def test_set_limits_overrides_some_kinds_status_shows_where_limits_come_from_and_clear_returns(url: str) -> None:
    from siq_celery.types import Limits

    q = IntervalQueue("geo", url=url, interval="100ms", burst=1, quota="100/1m", concurrency=5)
    q.declare()
    code, out = run(url, "set-limits", "geo", "--concurrency", "2", "--quota", "none")
    assert (code, out) == (0, "geo: limits burst 1, concurrency 2 (override: quota none, concurrency 2)\n")
    status = q.status()
    assert status.state.limits == Limits(1, 0, 0, 2)
    assert status.sources.limits_override_by.startswith(f"{getpass.getuser()}@")
    code, out = run(url, "status", "geo")
    row = out.strip().splitlines()[1]
    assert "burst 1, in flight 0/2 (override), no quota (override)" in row, out  # limits: what binds, and why
    assert "100ms; burst 1, quota 100/1m, concurrency 5" in row, out  # declared: the code's
    assert "quota none, concurrency 2 by " in row and " UTC" in row, out  # override: who and when
    shown = json.loads(run(url, "status", "geo", "--json")[1])[0]
    assert shown["limits_override"] == {"quota": 0, "window_s": None, "concurrency": 2}
    assert shown["declared_limits"] == {"burst": 1, "quota": 100, "window_s": 60.0, "concurrency": 5}
    assert shown["limits_override_by"] == status.sources.limits_override_by
    assert run(url, "set-limits", "geo", "--burst", "0") == (0, "geo: limits concurrency 2 (override: burst 0)\n")
    code, out = run(url, "set-limits", "geo", "--clear")
    assert (code, out) == (0, "geo: limits override cleared, limits burst 1, quota 100/1m, concurrency 5\n")
    assert not q.status().sources.limits_override


def test_a_margin_set_at_runtime_is_shown_apart_from_the_interval_it_spaces(url: str) -> None:
    q = IntervalQueue("geo", url=url, interval="100ms", margin="2ms")
    q.declare()
    code, out = run(url, "set-limits", "geo", "--margin", "5ms")
    assert (code, out) == (0, "geo: limits margin 5ms (override: margin 5ms)\n")
    assert q.status().state.interval_us == 105_000  # what the starts are spaced by
    row = run(url, "status", "geo")[1].strip().splitlines()[1]
    assert row.split()[1] == "100ms" and "margin 5ms (override)" in row, row
    shown = json.loads(run(url, "status", "geo", "--json")[1])[0]
    assert (shown["interval_s"], shown["margin_s"], shown["limits_override"]) == (0.1, 0.005, {"margin_s": 0.005})
    assert shown["declared_limits"]["margin_s"] == 0.002
    assert run(url, "set-limits", "geo", "--margin", "none")[1] == "geo: limits none (override: margin none)\n"
    assert q.status().state.interval_us == 100_000


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["set-limits", "geo"], 2, "give --burst, --quota, --concurrency or --margin, or --clear"),
        (["set-limits", "geo", "--margin", "soon"], 2, "margin 'soon': a duration from 0 to 60 s"),
        (["set-limits", "geo", "--burst", "1", "--clear"], 2, "(not both)"),
        # a bad value is a usage error (2), as set-interval's, backoff's and resume's are
        (["set-limits", "geo", "--burst", "-1"], 2, "burst -1: a whole number of starts from 0 to 10000"),
        (["set-limits", "geo", "--burst", "two"], 2, "burst 'two': a whole number"),
        (["set-limits", "geo", "--quota", "fast"], 2, "quota 'fast': write it as 'N/period'"),
        (["set-limits", "geo", "--concurrency", "0"], 2, "from 1 to 100000"),
        (["set-interval", "geo", "fast"], 2, "cannot parse interval"),
        (["backoff", "geo", "soon"], 2, "'30s'"),
        (["resume", "geo", "--grace", "soon"], 2, "'30s'"),
        (["top", "geo", "--refresh", "soon"], 2, "'30s'"),
        (["export", "geo", "--out", "-", "--since", "soon"], 2, "an ISO date/time"),
        (["set-limits", "nope", "--burst", "1"], 1, "queue 'nope' has no state"),
    ],
)
def test_set_limits_refuses_bad_input_in_one_line(url: str, args: list[str], code: int, message: str) -> None:
    IntervalQueue("geo", url=url, interval="100ms").ensure()
    got, out = run(url, *args)
    assert got == code and message in out and out.count("\n") == 1 and "Traceback" not in out, out
    assert not IntervalQueue("geo", url=url).status().sources.limits_override


def test_celery_siq_set_limits_acts_on_the_apps_store(tmp_path: object) -> None:
    from types import SimpleNamespace

    from celery import Celery

    from siq_celery.cli.celery_command import siq as celery_siq

    store = f"sqlite:///{tmp_path}/app.db"
    IntervalQueue("api", url=store, interval="100ms", concurrency=4).declare()
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.siq_url = store
    result = CliRunner().invoke(celery_siq, ["set-limits", "api", "--concurrency", "2"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 0 and result.output == "api: limits concurrency 2 (override: concurrency 2)\n"
    assert IntervalQueue("api", url=store).status().state.concurrency == 2


def test_audit_without_pyspark_says_what_to_install_in_one_line(tmp_path: object) -> None:
    """PySpark missing (blocked here as an uninstalled module is): one line, exit 1."""
    import subprocess
    import sys

    blocked = "import sys; sys.modules['pyspark'] = None; from siq_celery.cli import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", blocked, "audit", f"{tmp_path}/ledger.jsonl", "--out", f"{tmp_path}/audit"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    print(result.stderr)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: siq audit needs PySpark")
    assert "pip install 'siq_celery[spark]'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("port", ["99999", "0", "-1", "65536"])
def test_an_exporter_port_out_of_range_is_a_one_line_usage_error(port: str, tmp_path: object) -> None:
    result = separate_runner().invoke(
        siq, ["--url", f"sqlite:///{tmp_path}/siq.db", "exporter", "--port", port, "--addr", "127.0.0.1"]
    )
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--port" in result.stderr and "65535" in result.stderr, result.stderr


def test_a_redis_database_that_is_not_a_number_is_one_line(redis_url: str) -> None:
    code, out = run(redis_url.rpartition("/")[0] + "/abc", "status")
    assert code == 1 and out.count("\n") == 1 and "/abc" in out and "not a number" in out, out


def test_pause_before_any_worker_creates_the_queue_paused_and_status_says_paused(url: str) -> None:
    code, out = run(url, "pause", "deploy")
    assert code == 0 and out == "paused deploy (no interval yet: the first worker's declaration sets it)\n", out
    code, out = run(url, "status", "deploy")
    _header, row = out.strip().splitlines()
    assert code == 0 and row.split()[1] == "none" and row.endswith(" paused"), out
    code, out = run(url, "resume", "deploy")
    assert code == 1 and "no interval yet" in out and out.count("\n") == 1, out
    IntervalQueue("deploy", url=url, interval="100ms").declare()  # the first worker starts
    code, out = run(url, "status", "deploy")
    row = out.strip().splitlines()[1]
    assert row.split()[1] == "100ms" and row.split()[8] == "yes" and row.endswith(" paused"), out
    assert run(url, "resume", "deploy", "--grace", "0") == (0, "resumed deploy\n")
    assert not run(url, "status", "deploy")[1].strip().splitlines()[1].endswith(" paused")


def test_siq_version_prints_the_package_version() -> None:
    from types import SimpleNamespace

    from celery import Celery

    import siq_celery
    from siq_celery.cli.celery_command import siq as celery_siq

    result = CliRunner().invoke(siq, ["--version"])
    assert (result.exit_code, result.output) == (0, f"siq {siq_celery.__version__}\n"), result.output
    app = Celery("version", broker="memory://", set_as_current=False)
    result = CliRunner().invoke(celery_siq, ["--version"], obj=SimpleNamespace(app=app))
    assert (result.exit_code, result.output) == (0, f"siq {siq_celery.__version__}\n"), result.output
