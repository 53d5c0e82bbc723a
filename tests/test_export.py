"""siq export: JSON Lines and Parquet, filters, progress, and nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from siq_celery import IntervalQueue
from siq_celery.cli import siq
from siq_celery.ledger import COLUMNS, StartRecord, arrow_schema
from siq_celery.observe.export import parse_time
from siq_celery.testing import PinnedClock
from tests.cli_runner import separate_runner

I = 100_000


@pytest.fixture
def store_url(request: pytest.FixtureRequest) -> str:
    return f"memory://export-{request.node.name}"


def run_queue(url: str, name: str, starts: int, clock: PinnedClock) -> int:
    """``starts`` authorized and finished starts one interval apart; the first start's time."""
    from siq_celery.backends import backend_from_url

    q = IntervalQueue(name, interval=0.1, backend=backend_from_url(url, clock=clock))
    t0 = q.ensure().last_start_us
    for i in range(1, starts + 1):
        ticket = q.claim()
        clock.now_us = t0 + i * I
        assert q.start(ticket, task_id=f"{name}-{i}", record=StartRecord("job", f"{name}-{i}", "h", 1)).authorized
        q.finish(f"{name}-{i}", "FAILURE" if i == 2 else "SUCCESS")
    return t0 + I


def export(url: str, *args: str) -> tuple[int, str, str]:
    result = separate_runner().invoke(siq, ["--url", url, "export", *args])
    return result.exit_code, result.stdout, result.stderr


def test_json_lines_one_row_per_start_with_its_finish(store_url: str, tmp_path: Path) -> None:
    run_queue(store_url, "geo", 5, PinnedClock())
    code, out, _ = export(store_url, "geo", "--out", str(tmp_path / "geo.jsonl"))
    assert code == 0 and "exported 5 ledger rows of 1 queue(s)" in out
    rows = [json.loads(line) for line in (tmp_path / "geo.jsonl").read_text().splitlines()]
    assert [r["ticket"] for r in rows] == [1, 2, 3, 4, 5] and tuple(rows[0]) == COLUMNS
    assert [r["outcome"] for r in rows] == ["SUCCESS", "FAILURE", "SUCCESS", "SUCCESS", "SUCCESS"]
    assert all(r["v"] == 5 and r["cost"] == 1 and r["finish_us"] == r["start_us"] for r in rows)
    assert all((r["fair_key"], r["fair_tag"], r["fair_weight"]) == ("", -1, 0) for r in rows)  # no fair share
    assert all(r["quota"] == r["concurrency"] == r["lease_us"] == 0 and r["lease_returned"] is None for r in rows)


def test_an_export_carries_the_limits_in_force_and_each_lease_given_back(store_url: str, tmp_path: Path) -> None:
    """What ``siq audit`` checks the window quota, the concurrency cap and fair shares by,
    in both formats."""
    from siq_celery.backends import backend_from_url

    clock = PinnedClock()
    backend = backend_from_url(store_url, clock=clock, lease_timeout_us=30_000_000)
    q = IntervalQueue("api", interval=0.1, quota="10/1m", concurrency=2, burst=1, backend=backend)
    t0 = q.ensure().last_start_us
    for i in range(1, 4):
        clock.now_us = t0 + i * I
        share = (f"tenant-{i % 2}", 720_720 * i, i) if i > 1 else ("", -1, 0)
        d = q.start(q.claim(), task_id=f"t{i}", record=StartRecord("job", f"t{i}", "h", 1, 0, *share))
        if i < 3:
            clock.now_us += 50
            q.finish(f"t{i}", lease=d.lease)
    for name in ("api.jsonl", "api.parquet"):
        assert export(store_url, "api", "--out", str(tmp_path / name))[0] == 0
    rows = [json.loads(line) for line in (tmp_path / "api.jsonl").read_text().splitlines()]
    assert pq.read_table(tmp_path / "api.parquet").to_pylist() == rows
    assert [(r["quota"], r["window_us"], r["concurrency"], r["burst"], r["lease_us"]) for r in rows] == [
        (10, 60_000_000, 2, 1, 30_000_000)
    ] * 3
    assert [(r["finish_us"] and r["finish_us"] - r["start_us"], r["lease_returned"]) for r in rows] == [
        (50, True),
        (50, True),
        (None, None),
    ]
    assert [(r["fair_key"], r["fair_tag"], r["fair_weight"]) for r in rows] == [
        ("", -1, 0),
        ("tenant-0", 2 * 720_720, 2),
        ("tenant-1", 3 * 720_720, 3),
    ]


def test_parquet_has_the_documented_schema(store_url: str, tmp_path: Path) -> None:
    run_queue(store_url, "geo", 3, PinnedClock())
    code, _, _ = export(store_url, "--out", str(tmp_path / "all.parquet"))
    assert code == 0
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.schema.equals(arrow_schema()) and table.num_rows == 3


def test_since_until_and_patterns_select_rows(store_url: str, tmp_path: Path) -> None:
    clock = PinnedClock()
    first = run_queue(store_url, "shop:a", 5, clock)
    run_queue(store_url, "shop:b", 2, clock)
    run_queue(store_url, "other", 2, clock)
    since, until = str((first + I) / 1e6), str((first + 3 * I) / 1e6)
    code, _, _ = export(store_url, "shop:*", "--out", str(tmp_path / "x.jsonl"), "--since", since, "--until", until)
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert [(r["queue"], r["ticket"]) for r in rows] == [("shop:a", 2), ("shop:a", 3)]
    code, out, _ = export(store_url, "shop:*", "--out", "-")
    assert code == 0 and len(out.splitlines()) == 7


def test_bad_input_is_one_clear_line_and_writes_nothing(store_url: str, tmp_path: Path) -> None:
    run_queue(store_url, "geo", 2, PinnedClock())
    code, _, err = export(store_url, "--out", "-", "--format", "parquet")
    assert code == 1 and "only JSON Lines can be written to stdout" in err
    code, _, err = export(store_url, "--out", str(tmp_path / "x.jsonl"), "--since", "last tuesday")
    assert code == 2 and "expected an ISO date/time" in err  # a bad value: a usage error
    code, _, err = export(store_url, "--out", str(tmp_path / "missing" / "x.jsonl"))
    assert code == 1 and "does not exist" in err
    code, _, err = export(store_url, "--out", str(tmp_path / "x.jsonl"), "--format", "csv")
    assert code == 2
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_no_file(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_queue(store_url, "geo", 3, PinnedClock())
    import siq_celery.observe.export as export_module

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "PROGRESS_EVERY", 2)
    code, _, err = export(store_url, "--out", str(tmp_path / "x.jsonl"))
    assert code == 0 and "  2 rows" in err  # progress, on stderr
    (tmp_path / "x.jsonl").unlink()
    monkeypatch.setattr(export_module, "_write_jsonl", broken)
    result = CliRunner().invoke(siq, ["--url", store_url, "export", "--out", str(tmp_path / "x.jsonl")])
    assert result.exit_code != 0 and list(tmp_path.iterdir()) == []


def test_time_forms() -> None:
    assert parse_time("2026-11-21T08:00:00") == parse_time("2026-11-21T08:00:00+00:00") == 1795248000.0
    assert parse_time("1795248000") == 1795248000.0
    assert parse_time("2h", now=10_000.0) == 2800.0 and parse_time("7d", now=1e6) == 1e6 - 7 * 86400


def test_parked_tasks_export_as_json_lines(store_url: str, tmp_path: Path) -> None:
    from siq_celery.parked import ParkedTask

    q = IntervalQueue("geo", url=store_url, interval="100ms")
    q.ensure()
    tickets = q.claim_many(3)
    message = json.dumps({"task": "geo.lookup", "args": [1], "kwargs": {}, "options": {}})
    q.backend.park("geo", tickets[0].epoch, [ParkedTask(t.number, f"t{t.number}", message) for t in tickets[1:]])
    code, _, err = export(store_url, "geo", "--parked", "--out", str(tmp_path / "parked.jsonl"))
    assert code == 0 and "exported 2 parked tasks of 1 queue(s)" in err + _
    rows = [json.loads(line) for line in (tmp_path / "parked.jsonl").read_text().splitlines()]
    assert [(r["ticket"], r["task_id"], r["message"]["task"]) for r in rows] == [
        (2, "t2", "geo.lookup"),
        (3, "t3", "geo.lookup"),
    ]


def test_a_sqlite_ledger_from_before_costs_were_recorded_reads_as_cost_1(tmp_path: Path) -> None:
    """A database whose ledger table predates the cost column (and the limits) gets them
    when first opened: old rows read as cost 1 without limits, new starts record theirs."""
    import sqlite3

    from siq_celery.backends import backend_from_url

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE siq_ledger (prefix TEXT NOT NULL, queue TEXT NOT NULL, epoch TEXT NOT NULL, "
            "ticket INTEGER NOT NULL, task_id TEXT, task_name TEXT NOT NULL, slot_us INTEGER NOT NULL, "
            "start_us INTEGER NOT NULL, interval_us INTEGER NOT NULL, finish_us INTEGER, outcome TEXT, "
            "deferrals INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL)"
        )
        conn.execute("INSERT INTO siq_ledger VALUES ('siq', 'geo', 'old', 7, 'x', 'job', 1, 2, 100000, 3, "
                     "'SUCCESS', 0, 'h', 1)")  # fmt: skip
    clock = PinnedClock()
    q = IntervalQueue("geo", interval=0.1, backend=backend_from_url(f"sqlite:///{path}", clock=clock))
    t0 = q.ensure().last_start_us
    ticket = q.claim(4)
    clock.now_us = t0 + I
    assert q.start(ticket, task_id="y", record=StartRecord("job", "y", "h", 1), cost=4).authorized
    assert [(r.epoch, r.ticket, r.cost) for r in q.ledger()] == [("old", 7, 1), (ticket.epoch, 1, 4)]
    old = next(iter(q.ledger()))  # and no limits, no lease (ledger schema 3's columns), no fair share (4's),
    assert (old.burst, old.quota, old.window_us, old.concurrency, old.lease_us) == (0, 0, 0, 0, 0)
    assert old.lease_returned is None and (old.fair_key, old.fair_tag, old.fair_weight) == ("", -1, 0)
    assert old.began_us is None  # no report (5's)
