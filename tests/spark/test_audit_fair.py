"""siq audit of fair shares (ledger schema 4): ledgers served by the reference lines
(rules.fair_push / fair_next), an unfair stretch injected, every figure checked against a
plain Python reading of the same rows (PySpark local[2])."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from siq_celery.ledger import COLUMNS, LedgerRow
from siq_celery.rules import DictFairLines, FairTurn, fair_next, fair_push
from siq_celery.spark.audit import _hour_of, auditable, read_ledger, run_audit
from siq_celery.spark.fair import fair_rows, in_ticket_order

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HOUR = 3_600_000_000
T0 = 1_790_000_000 * 1_000_000 // HOUR * HOUR  # on the hour
INTERVAL = 1_000_000  # 1 s a slot: ~3,500 starts a queue cover two hours
PER_PIECE = 400
MOVED = 5  # starts of one tenant moved ahead of their turn


def served(seed: int, phases: int) -> list[FairTurn]:
    """The turns the reference lines serve: in each phase the tenants submit a backlog,
    and more arrives while it is served, until every line is empty (the tags start over
    from 0). "dune" comes in the second half, when "bolt"'s weight goes from 2 to 4."""
    rng = random.Random(seed)
    lines, turns, sent = DictFairLines(), [], Counter[str]()

    def submit(key: str, count: int, later: bool) -> None:
        weight = {"acme": 1, "bolt": 4 if later else 2, "cyan": 3, "dune": 1}[key]
        for _ in range(count):
            fair_push(lines, key, f"{key}-{sent[key]}", rng.choice((1, 1, 2)), weight)
            sent[key] += 1

    for phase in range(phases):
        later = phase >= phases // 2
        keys = ["acme", "bolt", "cyan", *(["dune"] if later else [])]
        for key in keys:
            submit(key, rng.randint(40, 120), later)
        while (turn := fair_next(lines)) is not None:
            turns.append(turn)
            if rng.random() < 0.15:  # a tenant joins (again) while the others have work
                submit(rng.choice(keys), rng.randint(1, 4), later)
    return turns


def ledger(queue: str, turns: list[FairTurn], reset_at: int) -> list[LedgerRow]:
    """One row per turn, in ticket order (a start of cost c holds c tickets and c slots);
    the queue's state is reset (epoch e2, tickets from 1) at turn ``reset_at``."""
    rows, ticket, slot = [], 1, T0
    for n, t in enumerate(turns):
        if n == reset_at:
            ticket = 1
        epoch = "e1" if n < reset_at else "e2"
        rows.append(LedgerRow(queue, epoch, ticket, t.task_id, "call", slot, slot + 300, INTERVAL, slot + 900,
                              "SUCCESS", 0, "node1", 100, cost=t.cost, fair_key=t.key, fair_tag=t.tag,
                              fair_weight=t.weight))  # fmt: skip
        ticket, slot = ticket + t.cost, slot + t.cost * INTERVAL
    return rows


def unfair(rows: list[LedgerRow]) -> list[str]:
    """The audit's rule, read plainly: in ticket order within an epoch, a start whose tag
    is below the largest tag before it since the last tag 0."""
    out, highest = [], {}
    for r in sorted(rows, key=lambda r: (r.queue, r.epoch, r.ticket, r.start_us)):
        place = (r.queue, r.epoch)
        if r.fair_tag == 0:
            highest[place] = 0
        elif r.fair_tag < highest.get(place, -1):
            out.append(r.task_id)
        highest[place] = max(highest.get(place, -1), r.fair_tag)
    return out


def piece_of(ticket: int, t0: int, t1: int, pieces: int) -> int:
    """The piece of a ticket, as the audit computes it (pieces.in_pieces over tickets)."""
    return int((float(ticket) - float(t0)) / (float(t1) - float(t0) + 1.0) * pieces // 1)


def inject(rows: list[LedgerRow], reset_at: int) -> list[str]:
    """Move MOVED starts of "acme" ahead of their turn, in epoch e1, so that the moved
    block ends just before a piece begins: the starts after it with smaller tags were
    handed their tickets out of fair order, the first of them found only by what the
    earlier piece carries. Tickets and slots are numbered again; the moved task ids."""
    t0, t1 = 1, max(r.ticket for r in rows)
    pieces = -(-len(rows) // PER_PIECE)
    for at in range(200, reset_at - 300):
        later = [j for j in range(at + 60, at + 300) if rows[j].fair_key == "acme"][:MOVED]
        if len(later) < MOVED or rows[later[-1]].fair_tag <= rows[at].fair_tag:
            continue
        cost = sum(rows[j].cost for j in later)
        same_period = all(r.fair_tag > 0 for r in rows[at : later[-1] + 1])
        last = rows[at].ticket + cost - 1  # the moved block's last ticket
        if same_period and piece_of(last + 1, t0, t1, pieces) > piece_of(last, t0, t1, pieces):
            break
    else:
        raise AssertionError("no place to inject")
    moved = [rows[j] for j in later]
    rest = [r for j, r in enumerate(rows[:reset_at]) if j not in later]
    reordered = rest[:at] + moved + rest[at:]
    ticket, slot = 1, T0
    for r in reordered:
        r.ticket, r.slot_us, r.start_us, r.finish_us = ticket, slot, slot + 300, slot + 900
        ticket, slot = ticket + r.cost, slot + r.cost * INTERVAL
    rows[:reset_at] = reordered
    for r in rows[reset_at:]:  # e2 goes on after e1's last slot
        r.slot_us, r.start_us, r.finish_us = slot, slot + 300, slot + 900
        slot += r.cost * INTERVAL
    after = reordered[at + MOVED]  # out of fair order, found by what the earlier piece carries
    assert piece_of(moved[-1].ticket, t0, t1, pieces) < piece_of(after.ticket, t0, t1, pieces)
    assert after.fair_tag < moved[-1].fair_tag
    return [r.task_id for r in moved]


def shares(rows: list[LedgerRow]) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[tuple[str, str, int], Any]]:
    """fair_keys and fair_hours, plainly: (queue, key) -> figures, (queue, key, hour) -> figures."""
    hours: dict[tuple[str, int], dict[str, list[LedgerRow]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        hours[(r.queue, r.start_us // HOUR)][r.fair_key].append(r)
    per_hour, totals = {}, defaultdict(lambda: {"starts": 0, "units": 0, "expected": 0.0, "last": (0, 0, 0)})
    queue_units: Counter[str] = Counter()
    for (queue, hour), by_key in hours.items():
        units = {k: sum(r.cost for r in rs) for k, rs in by_key.items()}
        weight = {k: max((r.start_us, r.ticket, r.fair_weight) for r in rs)[2] for k, rs in by_key.items()}
        hour_units, weights = sum(units.values()), sum(weight.values())
        queue_units[queue] += hour_units
        for k, rs in by_key.items():
            share, weight_share = units[k] / hour_units, weight[k] / weights
            per_hour[(queue, k, hour)] = {"starts": len(rs), "units": units[k], "weight": weight[k],
                                          "share": share, "weight_share": weight_share}  # fmt: skip
            total = totals[(queue, k)]
            total["starts"] += len(rs)
            total["units"] += units[k]
            total["expected"] += weight[k] / weights * hour_units
            total["last"] = max(total["last"], max((r.start_us, r.ticket, r.fair_weight) for r in rs))
    per_key = {
        (q, k): {"starts": t["starts"], "units": t["units"], "weight": t["last"][2],
                 "share": t["units"] / queue_units[q], "weight_share": t["expected"] / queue_units[q]}
        for (q, k), t in totals.items()
    }  # fmt: skip
    return per_key, per_hour


def write(rows: list[LedgerRow], plain: list[LedgerRow], path: Path) -> list[str]:
    """The fair rows as Parquet (schema 4), and rows of a queue without fair tasks as JSON
    Lines of schema 3 (no fair columns at all)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from siq_celery.ledger import arrow_schema

    pq.write_table(
        pa.table({c: [getattr(r, c) for r in rows] for c in COLUMNS}, schema=arrow_schema()), path / "fair.parquet"
    )
    with open(path / "plain.jsonl", "w") as f:
        for r in plain:
            f.write(json.dumps({k: v for k, v in r.as_dict().items() if not k.startswith("fair_")} | {"v": 3}) + "\n")
    return [str(path / "fair.parquet"), str(path / "plain.jsonl")]


def test_an_injected_unfair_stretch_is_counted_exactly_and_each_tenants_share_reported(
    spark: Any, tmp_path: Path
) -> None:
    turns = {"fair:one": served(1, 8), "fair:two": served(2, 6)}
    # The reference serves tags in order within each busy period, but not keys: a tenant
    # that joins at the current virtual time goes after a larger key of the same tag.
    for queue_turns in turns.values():
        assert unfair(ledger("q", queue_turns, len(queue_turns))) == []
        ties = [(a.key, b.key) for a, b in itertools.pairwise(queue_turns) if a.tag == b.tag > 0]
        assert any(b < a for a, b in ties), "equal tags out of key order: why only tags are checked"
    one = ledger("fair:one", turns["fair:one"], reset_at=2 * len(turns["fair:one"]) // 3)
    two = ledger("fair:two", turns["fair:two"], reset_at=len(turns["fair:two"]) // 2)
    assert len(one) > 3_000 and len(two) > 2_000
    moved = inject(one, reset_at=2 * len(turns["fair:one"]) // 3)
    expected = unfair(one + two)
    assert expected and not set(moved) & set(expected) and len(expected) == len(set(expected))
    assert {r.task_id for r in one if r.task_id in expected} == set(expected)  # all in the injected queue
    plain = [LedgerRow("plain", "e1", n, f"p{n}", "call", T0 + n * INTERVAL, T0 + n * INTERVAL, INTERVAL)
             for n in range(1, 200)]  # fmt: skip
    paths = write(one + two, plain, tmp_path)
    rows = fair_rows(auditable(read_ledger(spark, paths)).withColumn("hour_n", _hour_of()))
    for per_piece in (13, 37):  # busy periods over many pieces: what each carries in from the earlier ones
        got = in_ticket_order(rows, per_piece).filter("unfair = 1").select("task_id").collect()
        assert sorted(r["task_id"] for r in got) == sorted(expected), per_piece

    reports = [
        run_audit(spark, paths, str(tmp_path / f"audit{n}"), log=lambda _: None, rows_per_piece=n)
        for n in (PER_PIECE, 10**9)
    ]
    report = reports[0]
    for name in ("fair_keys", "fair_hours", "fair_order", "unfair", "summary"):
        assert reports[0][name] == reports[1][name], name  # however the queues are cut
    order = {(h["queue"], h["hour"]): h for h in report["fair_order"]}
    assert {q for q, _ in order} == {"fair:one", "fair:two"}, "no fair rows: no fair figures"
    assert sum(h["unfair"] for h in report["fair_order"]) == len(expected)
    assert sum(h["unfair"] for (q, _), h in order.items() if q == "fair:two") == 0
    assert sum(h["fair_starts"] for h in report["fair_order"]) == len(one) + len(two)
    assert sum(h["busy_periods"] for h in report["fair_order"]) == sum(r.fair_tag == 0 for r in one + two)
    found = spark.read.parquet(str(tmp_path / f"audit{PER_PIECE}" / "unfair")).collect()
    assert sorted(r["task_id"] for r in found) == sorted(expected)
    first = sorted((r for r in one if r.task_id in expected), key=lambda r: (r.epoch, r.ticket))[:20]
    assert [r["task_id"] for r in report["unfair"]] == [r.task_id for r in first]
    assert all(r["fair_tag"] < r["highest_before"] for r in report["unfair"])

    per_key, per_hour = shares(one + two)
    got_keys = {(r["queue"], r["fair_key"]): r for r in report["fair_keys"]}
    assert set(got_keys) == set(per_key) and len(per_key) == 8
    for place, want in per_key.items():
        got = got_keys[place]
        assert {k: got[k] for k in ("starts", "units", "weight")} == {k: want[k] for k in ("starts", "units", "weight")}
        assert got["share"] == pytest.approx(want["share"], abs=1e-6), place
        assert got["weight_share"] == pytest.approx(want["weight_share"], abs=1e-6), place
    assert got_keys[("fair:one", "bolt")]["weight"] == 4 and got_keys[("fair:one", "dune")]["weight"] == 1
    got_hours = {(r["queue"], r["fair_key"], r["hour"]): r for r in report["fair_hours"]}
    assert len(got_hours) == len(per_hour) and len({h for _, _, h in got_hours}) >= 2
    for (queue, key, hour), want in per_hour.items():
        got = got_hours[(queue, key, _hour_name(hour))]
        assert (got["starts"], got["units"], got["weight"]) == (want["starts"], want["units"], want["weight"])
        assert got["share"] == pytest.approx(want["share"], abs=1e-6)
        assert got["weight_share"] == pytest.approx(want["weight_share"], abs=1e-6)
    html = (tmp_path / f"audit{PER_PIECE}" / "report.html").read_text()
    assert html.count("<h3>fair shares</h3>") == 2 and f"{len(expected)} handed their tickets out" in html


def _hour_name(hour_n: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(hour_n * 3600, UTC).strftime("%Y-%m-%d %H:00")
