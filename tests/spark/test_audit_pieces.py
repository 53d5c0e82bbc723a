"""The audit's start order computed in pieces gives the answers of one window over the
whole queue: faults placed on the first and last rows of pieces, across an empty piece,
in two epochs, checked row by row against a plain Python reading of the same ledger."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from siq_celery.ledger import COLUMNS, LedgerRow
from siq_celery.spark.audit import read_ledger, run_audit
from siq_celery.spark.pieces import queue_in_start_order

pytestmark = [pytest.mark.spark, pytest.mark.slow]

INTERVAL = 20_000
T0 = 1_790_000_000_000_000
ROWS, PIECES = 6_000, 12
TOLERANCE = 1_000


def piece_of(start_us: int, t0: int, t1: int, pieces: int) -> int:
    """The piece of a start, as the audit computes it (pieces.in_pieces)."""
    return int((float(start_us) - float(t0)) / (float(t1) - float(t0) + 1.0) * pieces // 1)


def first_start_of(piece: int, t0: int, t1: int, pieces: int) -> int:
    """The earliest microsecond that falls in ``piece``."""
    guess = t0 + (t1 - t0 + 1) * piece // pieces
    while piece_of(guess - 1, t0, t1, pieces) >= piece:
        guess -= 1
    while piece_of(guess, t0, t1, pieces) < piece:
        guess += 1
    return guess


def boundary_ledger() -> tuple[list[LedgerRow], dict[str, Any]]:
    """One queue, two epochs, rows one interval apart, and faults where pieces meet."""
    starts = [T0 + n * INTERVAL + (n * 37) % 200 for n in range(ROWS)]
    t0, t1 = starts[0], starts[-1]  # no fault moves the first or the last start
    epochs = ["e2" if n % 7 == 3 else "e1" for n in range(ROWS)]

    def last_before(piece: int) -> int:
        return max(i for i, t in enumerate(starts) if piece_of(t, t0, t1, PIECES) < piece)

    violations, inversions = [last_before(p) for p in (2, 5, 9)], [last_before(p) for p in (3, 7)]
    for i in violations + inversions:
        epochs[i] = epochs[i + 1] = "e1"  # each pair in one epoch, where order is checked
    numbered: dict[str, int] = {}
    rows = []
    for n, (start, epoch) in enumerate(zip(starts, epochs, strict=True)):
        numbered[epoch] = numbered.get(epoch, 0) + 1
        rows.append(LedgerRow("api", epoch, numbered[epoch], f"t{n}", "call", start - 50, start, INTERVAL,
                              start + 5_000, "SUCCESS", 0, f"node{n % 2}", 100 + n % 4))  # fmt: skip
    placed: dict[str, Any] = {"violations_across": [], "inversions_across": []}
    for i, piece in zip(violations, (2, 5, 9), strict=True):
        # the first row of a piece, 1 µs after the last row of the piece before
        edge = first_start_of(piece, t0, t1, PIECES)
        rows[i].start_us, rows[i + 1].start_us = edge - 1, edge
        placed["violations_across"].append(rows[i + 1].task_id)
    for i in inversions:  # the last and the first row of neighbouring pieces swap tickets
        rows[i].ticket, rows[i + 1].ticket = rows[i + 1].ticket, rows[i].ticket
        placed["inversions_across"].append(rows[i + 1].task_id)
    # an empty piece: the highest ticket before piece 11 comes from piece 9
    placed["emptied"] = sum(piece_of(r.start_us, t0, t1, PIECES) == 10 for r in rows)
    rows = [r for r in rows if piece_of(r.start_us, t0, t1, PIECES) != 10]
    before = max(i for i, r in enumerate(rows) if piece_of(r.start_us, t0, t1, PIECES) == 9 and r.epoch == "e1")
    after = next(i for i, r in enumerate(rows) if piece_of(r.start_us, t0, t1, PIECES) == 11 and r.epoch == "e1")
    rows[before].ticket, rows[after].ticket = rows[after].ticket, rows[before].ticket
    placed["inversions_across"].append(rows[after].task_id)
    return rows, placed


def reference(rows: list[LedgerRow]) -> dict[str, tuple[int, int, int | None]]:
    """One pass over the queue in (start_us, ticket) order: task id -> (violation,
    inversion, gap), as a single window over the whole queue defines them."""
    out: dict[str, tuple[int, int, int | None]] = {}
    highest: dict[str, int] = {}
    ordered = sorted(rows, key=lambda r: (r.start_us, r.ticket))
    for prev, r in itertools.pairwise([None, *ordered]):
        gap = None if prev is None else r.start_us - prev.start_us
        violation = int(gap is not None and gap < r.interval_us - TOLERANCE)
        inversion = int(r.epoch in highest and r.ticket < highest[r.epoch])
        highest[r.epoch] = max(highest.get(r.epoch, r.ticket), r.ticket)
        out[r.task_id] = (violation, inversion, gap)
    return out


def write(rows: list[LedgerRow], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from siq_celery.ledger import arrow_schema

    pq.write_table(pa.table({c: [getattr(r, c) for r in rows] for c in COLUMNS}, schema=arrow_schema()), path)


def test_faults_where_pieces_meet_are_found_as_one_window_finds_them(spark: Any, tmp_path: Path) -> None:
    rows, placed = boundary_ledger()
    write(rows, tmp_path / "ledger.parquet")
    expected = reference(rows)
    per_piece = -(-len(rows) // PIECES)  # PIECES pieces of the queue, one of them empty
    df = read_ledger(spark, [str(tmp_path / "ledger.parquet")])
    got = {
        r["task_id"]: (r["violation"], r["inversion"], r["gap_us"], r["piece"])
        for r in queue_in_start_order(df, TOLERANCE, rows_per_piece=per_piece).collect()
    }
    # the faults really sit where pieces meet: the row before each is in another piece
    pieces = {tid: v[3] for tid, v in got.items()}
    order = sorted(rows, key=lambda r: (r.start_us, r.ticket))
    position = {r.task_id: i for i, r in enumerate(order)}
    for tid in placed["violations_across"] + placed["inversions_across"]:
        before = order[position[tid] - 1].task_id
        assert pieces[before] < pieces[tid], (tid, pieces[before], pieces[tid])
    assert len(set(pieces.values())) == PIECES - 1 and placed["emptied"] > 0  # one piece left empty
    assert {tid: v[:3] for tid, v in got.items()} == expected
    assert sum(v[0] for v in expected.values()) == 3
    assert all(expected[tid][0] == 1 for tid in placed["violations_across"])
    assert all(expected[tid][1] == 1 for tid in placed["inversions_across"])
    assert sum(v[1] for v in expected.values()) == 3

    # and the whole report is the same however the queue is cut
    reports = [
        run_audit(spark, [str(tmp_path / "ledger.parquet")], str(tmp_path / f"audit{n}"), TOLERANCE,
                  log=lambda _: None, rows_per_piece=n)
        for n in (per_piece, 10**9)
    ]  # fmt: skip
    for name in ("summary", "by_day", "by_hour", "gaps", "rate", "workers"):
        assert reports[0][name] == reports[1][name], name
    [summary] = reports[0]["summary"]
    assert summary["violations"] == 3 and summary["inversions"] == sum(v[1] for v in expected.values())


def test_tickets_never_started_are_counted_exactly_across_mask_blocks(spark: Any, tmp_path: Path) -> None:
    """Tickets are counted in blocks of 64 (one bit each): numbers on both sides of block
    edges, below zero, and started twice, each count once."""
    # 64 twice: a ticket started twice; 0 is no ticket (a start with no place in the line)
    tickets = [-65, -1, 0, 1, 63, 64, 64, 127, 128, 130]
    rows = [
        LedgerRow("api", "e1", t, f"t{i}", "call", T0 + i * INTERVAL, T0 + i * INTERVAL, INTERVAL, None, None, 0,
                  "node0", 100)
        for i, t in enumerate(tickets)
    ]  # fmt: skip
    write(rows, tmp_path / "ledger.parquet")
    report = run_audit(spark, [str(tmp_path / "ledger.parquet")], str(tmp_path / "audit"), log=lambda _: None)
    [summary] = report["summary"]
    distinct = len(set(tickets) - {0})
    assert summary["missing_tickets"] == (130 - (-65) + 1) - distinct
    assert summary["starts"] == len(tickets) and summary["unfinished"] == len(tickets)


def test_tickets_of_weighted_starts_across_mask_blocks_are_all_used(spark: Any, tmp_path: Path) -> None:
    """A start of cost c uses tickets ticket .. ticket + c - 1: ranges that cross block
    edges, fill a whole block, and overlap, leave exactly the numbers no start used."""
    starts = [(1, 62), (63, 3), (66, 64), (130, 200), (200, 5), (400, 1)]  # (ticket, cost)
    rows = [
        LedgerRow("api", "e1", t, f"t{i}", "call", T0 + i * 10**7, T0 + i * 10**7, INTERVAL, None, None, 0,
                  "node0", 100, cost=c)
        for i, (t, c) in enumerate(starts)
    ]  # fmt: skip
    write(rows, tmp_path / "ledger.parquet")
    report = run_audit(spark, [str(tmp_path / "ledger.parquet")], str(tmp_path / "audit"), log=lambda _: None)
    used = set().union(*(range(t, t + c) for t, c in starts))
    [summary] = report["summary"]
    assert summary["missing_tickets"] == (400 - 1 + 1) - len(used) == 70
