"""siq audit of the limits beyond the interval (ledger schema 3): burst by GCRA, the window
quota and the concurrency cap, each against a plain Python reading of the same ledger, on
hand-made edge cases, cut into many pieces, and on a million synthetic rows whose injected
faults must be found exactly (count and task ids). PySpark local[2]."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from siq_celery.ledger import COLUMNS, LedgerRow
from siq_celery.spark.audit import read_ledger, run_audit, swept_starts
from siq_celery.spark.limits import verdicts
from siq_celery.spark.synthetic import LIMIT_QUEUES, QUEUES, write_synthetic_ledger

pytestmark = [pytest.mark.spark, pytest.mark.slow]

T0 = 1_790_000_000_000_000
I = 20_000
TOLERANCE = 1_000


def reference(rows: Iterable[LedgerRow], tolerance_us: int = TOLERANCE) -> dict[str, set[str]]:
    """Each limit's verdicts by their definitions (docs/design.md, "The audit"), one queue
    at a time in start order ((start, ticket); no test ties on both): task id -> the kinds
    it broke. Quadratic, for small ledgers."""
    found: dict[str, set[str]] = {}
    by_queue: dict[str, list[LedgerRow]] = {}
    for r in rows:
        by_queue.setdefault(r.queue, []).append(r)
    for queue_rows in by_queue.values():
        order = sorted(queue_rows, key=lambda r: (r.start_us, r.ticket))
        last: int | None = None  # the store's last_start_us, by GCRA's recursion
        for k, r in enumerate(order):
            kinds = found.setdefault(r.task_id or "", set())
            cost = max(r.cost, 1)
            if r.burst > 0 and last is not None and r.start_us < last + r.interval_us * (1 - r.burst) - tolerance_us:
                kinds.add("burst")
            last = r.start_us if last is None else max(last + r.interval_us, r.start_us)
            last += (cost - 1) * r.interval_us
            if r.quota > 0 and r.window_us > 0:
                units = sum(min(max(j.cost, 1), j.quota) for j in order[: k + 1]
                            if j.quota > 0 and j.window_us > 0 and j.start_us + j.window_us > r.start_us)  # fmt: skip
                if units > r.quota:
                    kinds.add("window")
            if r.concurrency > 0:
                held = sum(1 for j in order[:k] if j.concurrency > 0 and j.start_us < lease_end(j) > r.start_us)
                if held + 1 > r.concurrency:
                    kinds.add("concurrency")
    return {tid: kinds for tid, kinds in found.items() if kinds}


def lease_end(r: LedgerRow) -> int:
    """When a start's lease stopped counting: its finish if that gave it back, else one
    time to live after the start (a row with neither: at its start)."""
    if r.finish_us is not None and r.lease_returned is not False:
        return max(r.finish_us, r.start_us)
    return r.start_us + r.lease_us if r.lease_us > 0 else r.start_us


def write(rows: list[LedgerRow], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from siq_celery.ledger import arrow_schema

    pq.write_table(pa.table({c: [getattr(r, c) for r in rows] for c in COLUMNS}, schema=arrow_schema()), path)


def read_rows(path: Path) -> list[LedgerRow]:
    import pyarrow.parquet as pq

    return [LedgerRow(**{k: v for k, v in r.items() if k in COLUMNS}) for r in pq.read_table(path).to_pylist()]


def row(queue: str, n: int, start: int, *, finish: int | None = None, cost: int = 1, **fields: Any) -> LedgerRow:
    return LedgerRow(queue, "e1", n, f"{queue}-{n}", "call", start, start, fields.pop("interval_us", I), finish,
                     None if finish is None else "SUCCESS", 0, "node1", 100, cost, **fields)  # fmt: skip


def edge_ledger() -> list[LedgerRow]:
    """Edge cases of each limit (times in µs after T0); the starts that break one are
    marked ``# !``."""
    rows: list[LedgerRow] = []
    # quota 5 units per 100 ms, interval 10 ms: (start, cost)
    quota = {"interval_us": 10_000, "quota": 5, "window_us": 100_000}
    for n, (s, c) in enumerate([
        (0, 2), (20_000, 1), (30_000, 2),  # 5 units: full
        (100_000, 2),  # exactly one window after the first: it has left (5 units)
        (119_999, 1),  # ! 1 µs before the second leaves: 6 units
        (130_000, 1),  # the third left: 4
        (230_001, 9),  # a cost above the quota counts as the quota: 5, alone
        (240_000, 1),  # ! 6
    ], start=1):  # fmt: skip
        rows.append(row("quota", n, T0 + s, finish=T0 + s + 50, cost=c, **quota))
    rows.append(row("quota", 99, T0 + 229_000, interval_us=10_000))  # no quota recorded (v2): no units
    # cap 2, leases of 10 s: (start, finish); the finish gave the lease back unless noted
    spans = [
        (0, 0),  # a body of 0 µs: counted at its own start only
        (1, 30_000), (2, 40_000),  # 2 in flight
        (30_000, 35_000),  # the second ended at this very microsecond: 2
        (34_000, 50_000),  # ! 3
        (60_000, 200_000),  # finished after its lease (20 ms) expired: held until 80 ms
        (61_000, 70_000), (75_000, 78_000), (79_000, 90_000),  # 2 each
        (85_000, 120_000),  # 2: the expired lease no longer counts
        (100_000, None),  # never finished, lease 1 ms: held until 101 ms
        (100_500, 130_000),  # ! 3
        (130_000, 131_000),
        (140_000, None),  # never finished, no lease time recorded: counted at its start only
        (140_001, 150_000), (140_002, 160_000),  # 2
        (200_000, 300_000), (200_000, 300_000), (200_000, 210_000),  # ! the third at one microsecond
    ]  # fmt: skip
    for n, (s, f) in enumerate(spans, start=1):
        end = None if f is None else T0 + f
        rows.append(row("cap", n, T0 + s, finish=end, concurrency=2, lease_us=10_000_000,
                        lease_returned=None if f is None else True))  # fmt: skip
    cap = {r.ticket: r for r in rows if r.queue == "cap"}
    cap[6].lease_returned, cap[6].lease_us = False, 20_000
    cap[11].lease_us, cap[14].lease_us = 1_000, 0
    # burst 2 at 20 ms; then burst 0, checked pairwise
    starts = [
        0, 1, 2,  # 3 at once: the allowance
        100_000, 100_001, 100_002, 100_003,  # ! the fourth of a group
        200_000, 230_000, 240_000, 250_000, 260_000, 270_000,  # a line 10 ms apart catches up by 2...
        280_000,  # ! ...and no more
    ]  # fmt: skip
    for n, s in enumerate(starts, start=1):
        rows.append(row("burst", n, T0 + s, finish=T0 + s + 10, burst=2))
    for n, s in enumerate([400_000, 420_000, 430_000], start=len(starts) + 1):  # ! the last: 10 ms after
        rows.append(row("burst", n, T0 + s, finish=T0 + s + 10))
    return rows


def flags(spark: Any, path: Path, rows_per_piece: int) -> dict[str, set[str]]:
    """The audit's own verdicts of the limits, per task id, the queue cut into pieces of
    ``rows_per_piece``; the burst-0 rows' pairwise spacing check with them."""
    from pyspark.sql import functions as F

    from siq_celery.spark.audit import ordered_starts

    df = read_ledger(spark, [str(path)])
    got: dict[str, set[str]] = {}
    checked = verdicts(swept_starts(df, rows_per_piece), TOLERANCE)
    ids = df.select("queue", "epoch", "ticket", "start_us", "task_id")
    keys = ["queue", "epoch", "ticket", "start_us"]
    for r in checked.join(ids, keys).collect():
        for kind in ("burst", "window", "concurrency"):
            if r[f"{kind}_violation"]:
                got.setdefault(r["task_id"], set()).add(kind)
    pairwise = ordered_starts(df, TOLERANCE, rows_per_piece).filter(
        (F.col("violation") == 1) & (F.col("queue") == "burst")
    )
    pairwise = pairwise.join(ids, keys)
    for r in pairwise.collect():
        got.setdefault(r["task_id"], set()).add("burst")  # the reference's burst 0 is the pairwise check
    return got


def test_each_limit_is_checked_by_its_definition_however_the_queues_are_cut(spark: Any, tmp_path: Path) -> None:
    rows = edge_ledger()
    write(rows, tmp_path / "ledger.parquet")
    expected = reference(rows)
    expected["burst-17"] = {"burst"}  # burst 0: the pairwise check (10 ms after the one before)
    assert expected == {
        "quota-5": {"window"}, "quota-8": {"window"}, "cap-5": {"concurrency"}, "cap-12": {"concurrency"},
        "cap-19": {"concurrency"}, "burst-7": {"burst"}, "burst-14": {"burst"}, "burst-17": {"burst"},
    }  # fmt: skip
    for per_piece in (3, 10**6):  # many pieces, each a few rows (and their events), or one
        assert flags(spark, tmp_path / "ledger.parquet", per_piece) == expected, per_piece


def test_a_burst_within_its_allowance_is_no_violation_and_one_beyond_it_is_found(spark: Any, tmp_path: Path) -> None:
    """Groups of B + 1 starts at once, B + 4 intervals apart, are within GCRA's allowance
    (in any half-open window of length W at most ceil(W / I) + B starts): none is reported,
    where the spacing check without burst reported B a group. Groups of B + 2 are not: the
    last start of each, and only it, is reported."""
    queue = [("synthetic:burst", I, LIMIT_QUEUES[2][2])]
    burst = LIMIT_QUEUES[2][2].burst
    within = write_synthetic_ledger(str(tmp_path / "within.parquet"), 20_000, queues=queue)
    beyond = write_synthetic_ledger(str(tmp_path / "beyond.parquet"), 20_000, burst_overruns=23, queues=queue)
    rows = read_rows(tmp_path / "beyond.parquet")
    assert window_bound_broken(rows, burst) == set(beyond.expected["burst"]) and len(beyond.expected["burst"]) == 23
    assert window_bound_broken(read_rows(tmp_path / "within.parquet"), burst) == set()
    for ledger, injected in (("within", within), ("beyond", beyond)):
        report = run_audit(spark, [str(tmp_path / f"{ledger}.parquet")], str(tmp_path / ledger), TOLERANCE,
                           log=lambda _: None)  # fmt: skip
        [summary] = report["summary"]
        assert summary["violations"] == len(injected.expected["burst"]), ledger
        found = spark.read.parquet(str(tmp_path / ledger / "violations")).collect()
        assert {r["task_id"] for r in found} == set(injected.expected["burst"])
        assert all(r["gap_us"] < r["required_gap_us"] - TOLERANCE for r in found)
        assert summary["min_gap_ms"] < 0.02  # the starts of a group come microseconds apart
        assert (summary["reported_starts"], summary["body_violations"]) == (20_000, 0), ledger


def test_a_body_that_began_with_the_next_burst_is_found_on_the_bodies_clock(spark: Any, tmp_path: Path) -> None:
    """Every start within the burst's allowance on the store's clock, but the last body of
    some groups began with the next group (its report came late): that group holds B + 2
    bodies, and its last body, only it, is beyond the allowance on the bodies' clock."""
    queue = [("synthetic:burst", I, LIMIT_QUEUES[2][2])]
    burst = LIMIT_QUEUES[2][2].burst
    injected = write_synthetic_ledger(str(tmp_path / "late.parquet"), 20_000, body_burst_overruns=17, queues=queue)
    bodies = [replace(r, start_us=r.began_us) for r in read_rows(tmp_path / "late.parquet")]
    assert window_bound_broken(bodies, burst) == set(injected.expected["body_burst"])
    assert len(injected.expected["body_burst"]) == 17
    report = run_audit(spark, [str(tmp_path / "late.parquet")], str(tmp_path / "audit"), TOLERANCE, log=lambda _: None)
    [summary] = report["summary"]
    assert (summary["violations"], summary["body_violations"], summary["body_limit_violations"]) == (0, 17, 0)
    found = spark.read.parquet(str(tmp_path / "audit" / "body_violations")).collect()
    assert {r["task_id"] for r in found} == set(injected.expected["body_burst"])


def window_bound_broken(rows: list[LedgerRow], burst: int) -> set[str]:
    """The starts k for which some half-open window ending at k (of any length W, from
    a start j <= k) holds more than ceil(W / I) + burst starts: the bound itself, checked
    pair by pair (a group never reaches back past the group before it, so pairs within
    two groups suffice)."""
    order = sorted(rows, key=lambda r: (r.start_us, r.ticket))
    broken = set()
    for k, r in enumerate(order):
        for j in range(max(0, k - 4 * (burst + 2)), k + 1):
            length = r.start_us - order[j].start_us + 1
            if k - j + 1 > math.ceil(length / r.interval_us) + burst:
                broken.add(r.task_id or "")
    return broken


def test_a_million_rows_with_every_kind_of_fault_are_found_exactly(spark: Any, tmp_path: Path) -> None:
    """The spacing faults and the bodies' faults (a body that began too soon after the one
    before, a body that never reported) in the queues without limits, and the window and
    concurrency overruns and bursts beyond the allowance in the queues of each limit: each
    found once, by count and by task id, in one audit of 1,000,000 rows, whose report and
    tables say so."""
    ledger = tmp_path / "ledger.parquet"
    injected = write_synthetic_ledger(
        str(ledger), 1_000_000, violations=17, inversions=13, duplicates=11, missing=7, window_overruns=29,
        concurrency_overruns=31, burst_overruns=19, body_violations=13, unreported=17, queues=[*QUEUES, *LIMIT_QUEUES],
    )  # fmt: skip
    started = time.monotonic()
    report = run_audit(spark, [str(ledger)], str(tmp_path / "audit"), TOLERANCE, log=lambda _: None)
    print(f"1,000,000 rows audited in {time.monotonic() - started:.1f} s")
    summary = {q["queue"]: q for q in report["summary"]}
    total = {k: sum(q[k] for q in summary.values()) for k in ("starts", "violations", "inversions",
             "duplicate_starts", "missing_tickets", "window_violations", "concurrency_violations")}  # fmt: skip
    assert total == {"starts": 1_000_000, "violations": 17 + 19, "inversions": 13, "duplicate_starts": 11,
                     "missing_tickets": 7, "window_violations": 29, "concurrency_violations": 31}  # fmt: skip
    assert summary["synthetic:burst"]["violations"] == 19
    assert (
        summary["synthetic:window"]["max_window_units"] == 51 and summary["synthetic:concurrent"]["max_in_flight"] == 5
    )
    limit = spark.read.parquet(str(tmp_path / "audit" / "limit_violations")).collect()
    by_kind: dict[str, set[str]] = {}
    for r in limit:
        by_kind.setdefault(r["kind"], set()).add(r["task_id"])
    assert by_kind == {"window": set(injected.expected["window"]),
                       "concurrency": set(injected.expected["concurrency"])}  # fmt: skip
    assert all(r["value"] == r["limit"] + 1 for r in limit)
    spacing = spark.read.parquet(str(tmp_path / "audit" / "violations")).filter("queue = 'synthetic:burst'")
    assert {r["task_id"] for r in spacing.collect()} == set(injected.expected["burst"])
    on_disk = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert on_disk["summary"] == report["summary"] and on_disk["rows"] == 1_000_000 and on_disk["schema_version"] == 5
    # the bodies' clock: the reports that came, the bodies that began too soon after the one before
    bodies = {k: sum(q[k] for q in summary.values()) for k in ("reported_starts", "body_violations",
              "body_limit_violations")}  # fmt: skip
    # (the window's and the cap's overruns are the bodies' too: their bodies began with their starts)
    assert bodies == {"reported_starts": 1_000_000 - 17, "body_violations": 13, "body_limit_violations": 29 + 31}
    assert {q: summary[q]["body_violations"] for q in ("synthetic:fast", "synthetic:slow")} == {
        "synthetic:fast": 7,
        "synthetic:slow": 6,
    }
    body_rows = spark.read.parquet(str(tmp_path / "audit" / "body_violations"))
    # each the body after one whose report came half an interval late: half an interval and 400 us after it
    assert body_rows.count() == 13 and body_rows.filter("abs(gap_us * 2 - interval_us - 800) > 400").count() == 0
    plain = spark.read.parquet(str(tmp_path / "audit" / "violations")).filter(
        "queue IN ('synthetic:fast', 'synthetic:slow')"
    )
    assert plain.count() == 17 and plain.filter("gap_us * 2 > interval_us + 200").count() == 0
    assert spark.read.parquet(str(tmp_path / "audit" / "duplicates")).count() == 11
    html = (tmp_path / "audit" / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html and "synthetic:window" in html


def test_the_synthetic_faults_are_the_only_ones_by_the_definitions(tmp_path: Path) -> None:
    """The generator's claim checked without Spark, on a small ledger: the plain reading of
    each definition finds exactly the injected starts (and none in a ledger without them)."""
    for overruns in (0, 5):
        injected = write_synthetic_ledger(
            str(tmp_path / f"l{overruns}.parquet"), 6_000, window_overruns=overruns, concurrency_overruns=overruns,
            burst_overruns=overruns, queues=LIMIT_QUEUES,
        )  # fmt: skip
        found = reference(read_rows(tmp_path / f"l{overruns}.parquet"))
        expected = {tid: {kind} for kind, ids in injected.expected.items() for tid in ids}
        assert found == expected and len(expected) == 3 * overruns


def test_rows_of_every_schema_version_are_audited_together(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Version 1 and 2 rows carry no limits (read as none) beside version 3 rows of the
    same queue: the v2 starts take no part in the window or the cap."""
    rows = [row("api", n, T0 + n * I, finish=T0 + n * I + 10, quota=2, window_us=10 * I) for n in range(1, 7)]
    rows[4].start_us = rows[3].start_us + I // 2  # still a spacing violation (no burst)
    old = [row("api", 10 + n, T0 + 100 * I + n * I, finish=T0 + 100 * I + n * I + 10) for n in range(1, 4)]
    with open(tmp_path / "old.jsonl", "w") as f:
        for r in old:
            f.write(json.dumps({k: v for k, v in r.as_dict().items() if k in COLUMNS[:14]} | {"v": 2}) + "\n")
    write(rows, tmp_path / "new.parquet")
    report = run_audit(spark, [str(tmp_path / "old.jsonl"), str(tmp_path / "new.parquet")], str(tmp_path / "audit"),
                       log=lambda _: None)  # fmt: skip
    [q] = report["summary"]
    print(q)
    assert (q["starts"], q["violations"], q["window_violations"], q["concurrency_violations"]) == (9, 1, 4, 0)
    assert q["max_window_units"] == 6 and q["max_in_flight"] is None
    assert reference(rows) == {f"api-{n}": {"window"} for n in range(3, 7)}
    from siq_celery.spark.audit_cli import _print_report

    _print_report(report, str(tmp_path / "audit"))
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("api: ")]
    assert line.startswith("api: 9 starts") and line.endswith(", 4 window violations (at most 6 units)"), line
