"""The Redis store's scripts as Python sees them: their sources (the prelude of
:data:`PRELUDE`, then the script), the arguments built for them and their replies read back
(a state, a claim, a decision, the sources, a ledger entry). Times in integer microseconds
on the store's clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from ..ledger import BeganEntry, FinishEntry, LedgerRow, StartRecord
from ..types import (
    ClaimResult,
    Decision,
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    Verdict,
)

SCRIPTS = (
    "claim", "start", "restamp", "finish", "ensure", "pause", "resume", "set_interval", "reset", "status",
    "park", "release", "unpark", "backoff", "start_all", "declare", "renew", "set_limits", "fair_park", "delete",
    "fair_backlog", "began",
)  # fmt: skip


#: The prelude every script is loaded after, in this order (under ``siq_celery/``): the store's
#: own plumbing (``backends/lua/_*.lua``), then the rules of each limit kind, each beside its
#: Python twin (``rules/<kind>.lua`` and ``rules/<kind>.py``), the start decision that combines
#: them last. Lua's local functions must be defined before a function that calls them: each
#: file calls only what it or a file before it defines (tests/test_lua_layout.py).
PRELUDE = (
    "backends/lua/_store.lua", "backends/lua/_ledger.lua", "rules/declarations.lua", "rules/spacing.lua",
    "rules/tickets.lua", "rules/window.lua", "rules/concurrency.lua", "rules/fair.lua", "rules/counters.lua",
    "rules/line.lua",
)  # fmt: skip


def load_script_source(name: str) -> str:
    """The prelude (:data:`PRELUDE`, in its order) followed by the script ``name``, as one
    chunk (all shipped in the wheel)."""
    package = resources.files("siq_celery")
    parts = [package.joinpath(*path.split("/")) for path in (*PRELUDE, f"backends/lua/{name}.lua")]
    return "\n".join(part.read_text("utf-8") for part in parts)


#: Values of siq_sources_reply before its nodes, and per node.
_SOURCES_FIXED, _SOURCES_PER_NODE = 18, 8

#: Values of siq_reply (the state, the store time, the status-only times, the limits).
STATE_REPLY = 15


def _claim_result(reply: Sequence[Any]) -> ClaimResult:
    first, n, epoch, base, floor, interval, now = reply[:7]
    window = tuple(int(v) for v in reply[7:])
    return ClaimResult(int(first), int(n), epoch.decode(), int(base), int(floor), int(interval), int(now), window)


def _bulk(value: str | int | bytes) -> bytes:
    """One argument as RESP writes it (a bulk string)."""
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _resp(*args: str | int | bytes, count: int | None = -1) -> bytes:
    """A command as RESP writes it: ``*<count>`` (``count``: the number of arguments of the
    whole command when ``args`` is only its start; None: no header, ``args`` are its end)
    and each argument as a bulk string."""
    head = b"" if count is None else b"*%d\r\n" % (len(args) if count == -1 else count)
    return head + b"".join(_bulk(a) for a in args)


def _limit_args(limits: Limits) -> list[int]:
    return [limits.burst, limits.quota, limits.window_us, limits.concurrency, limits.margin_us]


def _decision(reply: Sequence[Any]) -> Decision:
    """{verdict, ticket, now_us, wait_us, slot_us, interval_us, lease, full} (start.lua)."""
    verdict, number, now, wait, slot, interval, lease, full = reply
    return Decision(
        Verdict(verdict.decode()), int(number), int(now), int(wait), int(slot), int(interval), _text(lease),
        bool(int(full)),
    )  # fmt: skip


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _limits(values: Sequence[Any]) -> Limits | None:
    """siq_limits_reply: five values, -1 each for none."""
    burst, quota, window, conc, margin = (int(v) for v in values)
    return None if burst < 0 else Limits(burst, quota, window, conc, margin)


def _override(values: Sequence[Any]) -> LimitsOverride:
    """siq_override_reply: burst, quota, window, concurrency, margin; -1: that kind not overridden."""
    burst, quota, window, conc, margin = (int(v) for v in values)
    return LimitsOverride(
        None if burst < 0 else burst, None if quota < 0 else quota, window if quota >= 0 else 0,
        None if conc < 0 else conc, None if margin < 0 else margin,
    )  # fmt: skip


def _sources(reply: Sequence[Any]) -> IntervalSources:
    """siq_sources_reply: six interval fields, the declared limits, the limits override, its
    origin and time; then (node, interval, expires, five limits) per live node."""
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
    nodes = tuple(
        sorted(
            (
                NodeDeclaration(text[i], int(text[i + 1]), int(text[i + 2]), _limits(text[i + 3 : i + 8]))
                for i in range(_SOURCES_FIXED, len(text), _SOURCES_PER_NODE)
            ),
            key=lambda n: n.node,
        )
    )
    return IntervalSources(
        int(text[0]), text[1], int(text[2]), int(text[3]), text[4], int(text[5]), nodes, _limits(text[6:11]),
        _override(text[11:16]), text[16], int(text[17]),
    )  # fmt: skip


def _ledger_entry(queue: str, raw: Mapping[bytes, bytes]) -> LedgerRow | FinishEntry | BeganEntry:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    if f.get("e") == "f":
        return FinishEntry(f["id"], int(f["ft"]), f["o"], f.get("l"), f.get("x") != "1")
    if f.get("e") == "b":
        return BeganEntry(f["id"] or None, int(f["st"]), int(f["bt"]))
    return LedgerRow(
        queue, f["ep"], int(f["t"]), f["id"] or None, f["n"], int(f["sl"]), int(f["st"]), int(f["iv"]),
        deferrals=int(f["d"]), host=f["h"], pid=int(f["p"]), cost=int(f.get("c", 1)), burst=int(f.get("b", 0)),
        quota=int(f.get("q", 0)), window_us=int(f.get("w", 0)), concurrency=int(f.get("k", 0)),
        lease_us=int(f.get("lt", 0)), lease=f.get("l"), fair_key=f.get("fk", ""), fair_tag=int(f.get("ft", -1)),
        fair_weight=int(f.get("fw", 0)),
    )  # fmt: skip


def _fair_args(record: StartRecord | None) -> list[Any]:
    """A start's fair share for its ledger entry (start.lua: ARGV[23..25]; start_all.lua: the
    last three): key ('' none), tag, weight."""
    if record is None or not record.fair_key:
        return ["", -1, 0]
    return [record.fair_key, record.fair_tag, record.fair_weight]
