"""``siq status``: a queue's state, limits, declarations and overrides, and who waits
most in a fair queue's lines."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from ..errors import QueueNotFoundError
from ..intervals import format_interval
from ..limits import NO_SPACING_US, format_limits, format_override
from ..observe.readings import has_limits, limits_text
from ..parked import FairBacklog
from ..types import NO_LIMITS, QueueStatus
from .options import SiqCommand, StoreOptions, one_line_errors, when_text


def _last_start(st: QueueStatus) -> str:
    """When the last start was authorized (what the ledger records), not the last slot a
    weighted start uses; '-' before the first."""
    return when_text(st.state.started_us, st.now_us) if st.state.started_us else "-"


def _next_start(st: QueueStatus) -> str:
    """'paused' while paused (no start is due); 'now' when a start could be authorized at
    once (an idle queue), else when."""
    if st.state.paused:
        return "paused"
    return "now" if st.next_start_us <= st.now_us else when_text(st.next_start_us, st.now_us)


def _spacing(st: QueueStatus) -> str:
    """The interval as declared (the margin is in the limits column); 'none' for a queue
    that only has a quota (no spacing of its own)."""
    return _interval_text(st.state.declared_interval_us)


def _interval_text(interval_us: int) -> str:
    """An interval as the status shows it: 'none' for no spacing of its own."""
    return "none" if interval_us <= NO_SPACING_US else format_interval(interval_us)


def status_rows(statuses: list[QueueStatus]) -> list[list[str]]:
    """The status table; a ``limits`` column only when a queue has a quota, a burst or a cap
    (or an operator's override of one)."""
    limits = any(has_limits(st) for st in statuses)
    rows = [[
        "queue", "interval", *(["limits"] if limits else []), "declared", "override", "ticket", "current", "backlog",
        "parked", "paused", "last start", "next start",
    ]]  # fmt: skip
    for st in statuses:
        s = st.state
        rows.append([
            st.queue, _spacing(st), *([limits_text(st)] if limits else []), _declared(st), _override(st),
            str(s.ticket), str(s.current), str(s.backlog), str(st.parked), "yes" if s.paused else "no",
            _last_start(st), _next_start(st),
        ])  # fmt: skip
    return rows


def _declared(st: QueueStatus) -> str:
    """The last declaration, and the live workers' ones where they differ from it; the same
    for the limits where any are declared."""
    src = st.sources
    if not src.declared_us:
        return "-"
    others = sorted({n.interval_us for n in src.live(st.now_us)} - {src.declared_us})
    text = _interval_text(src.declared_us)
    if others:
        text += f" (live: {', '.join(_interval_text(i) for i in others)})"
    declared = src.declared_limits
    live = {n.limits for n in src.live(st.now_us) if n.limits is not None} - {declared}
    if declared and (declared != NO_LIMITS or live):
        text += f"; {format_limits(declared)}"
        if live:
            text += f" (live: {'; '.join(sorted(format_limits(lim) for lim in live))})"
    return text


def _override(st: QueueStatus) -> str:
    """The interval's override and the limits' override, each with who set it and when."""
    src, parts = st.sources, []
    if src.override_us:
        parts.append(f"{format_interval(src.override_us)} by {src.override_by or '?'} at {_stamp(src.override_at_us)}")
    if src.limits_override:
        parts.append(f"{format_override(src.limits_override)} by {src.limits_override_by or '?'} at "
                     f"{_stamp(src.limits_override_at_us)}")  # fmt: skip
    return "; ".join(parts) or "-"


def _stamp(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%d %H:%M:%S") + " UTC"


def render_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows)


@click.command("status", cls=SiqCommand)
@click.argument("queues", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per queue, in a list.")
@click.pass_obj
def status_command(store: StoreOptions, queues: tuple[str, ...], as_json: bool) -> None:
    """Show queues (all, or those named; glob patterns like 'shop:*' work), and who waits
    most in a fair queue's lines."""
    with one_line_errors():
        names: dict[str, bool] = {}  # name -> named explicitly (not found by a pattern)
        for q in queues or ("*",):
            if any(c in q for c in "*?["):
                names.update(dict.fromkeys(store.backend.queues(q), False))  # SCAN: never blocks Redis
            else:
                names[q] = True
        statuses = []
        for name, explicit in names.items():
            st = store.backend.status(name)
            if st is None and explicit:
                raise QueueNotFoundError(f"queue {name!r} has no state in this store")
            if st is not None:  # a listed per-key queue may have expired in the meantime
                statuses.append(st)
        # who waits in the fair lines: read only for the queues with tasks waiting there
        fair = {st.queue: store.backend.fair_backlog(st.queue, STATUS_FAIR_TOP) for st in statuses if st.fair_tasks}
    if as_json:
        click.echo(json.dumps([_status_dict(s, fair.get(s.queue)) for s in statuses], indent=2))
    elif statuses:
        click.echo(render_table(status_rows(statuses)))
        for queue, backlog in fair.items():
            click.echo(f"{queue}: {fair_text(backlog)}")
    else:
        click.echo("no queues")


#: Fairness keys ``siq status`` names per fair queue: those with the most waiting.
STATUS_FAIR_TOP = 5


def fair_text(backlog: FairBacklog) -> str:
    """Who waits in a queue's fair lines, for people: ``fair shares: 1,203 keys waiting,
    10,040 tasks; most waiting: A 9,000 (weight 1), gold 12 (weight 2), ...``."""
    keys, tasks = backlog.keys_waiting, backlog.tasks_waiting
    text = f"fair shares: {keys:,} key{'s' * (keys != 1)} waiting, {tasks:,} task{'s' * (tasks != 1)}"
    if backlog.top:
        most = [f"{key} {waiting:,} (weight {weight})" for key, waiting, weight in backlog.top]
        text += "; most waiting: " + ", ".join(most + ["..."] * (keys > len(backlog.top)))
    return text


def _status_dict(st: QueueStatus, backlog: FairBacklog | None) -> dict[str, object]:
    """The queue's status as JSON, with the keys that wait most in its fair lines (if any)."""
    out = st.as_dict()
    if backlog is not None:  # its own counts, read with the keys
        out["fair_keys_waiting"], out["fair_tasks_waiting"] = backlog.keys_waiting, backlog.tasks_waiting
    out["fair_most_waiting"] = backlog.as_dict()["most_waiting"] if backlog is not None else []
    return out
