"""The ``siq`` command: operate interval queues in a state store.

    siq --url redis://localhost:6379/0 status [QUEUE...] [--json]
    siq --url ... pause QUEUE | resume QUEUE | reset QUEUE [--yes]
    siq --url ... set-interval QUEUE 250ms | set-interval QUEUE --clear
    siq --url ... set-limits QUEUE [--burst N] [--quota 100/1m|none] [--concurrency N|none]
                             [--margin 5ms|none] | --clear
    siq --url ... export [QUEUE...] --out ledger.parquet [--since 2h --until ...]
    siq --url ... exporter [PATTERN...] [--port 9808] [--max-queues 1000] [--fair-top 10]
    siq --url ... top [PATTERN]
    siq audit LEDGER... --out DIR [--master local[*]] [--tolerance 1ms]
    siq demo [--workers 3 --concurrency 2 --tasks 60 --interval 100ms --out siq-demo.png]

``--url`` defaults to ``$SIQ_URL``. Errors are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from . import __version__
from .backends import Backend, backend_from_url
from .errors import CorruptStateError, QueueNotFoundError, SiqError, StoreUnavailableError, redacted
from .intervals import MAX_BACKOFF_US, format_interval, parse_duration, parse_interval
from .keys import DEFAULT_KEY_PREFIX
from .limits import NO_SPACING_US, format_limits, format_override, limits_override
from .model import no_limit_known
from .observe.export import FORMATS, format_for, ledger_rows, parse_time, write_parked, write_rows
from .observe.readings import has_limits, limits_text
from .queue import RESUME_GRACE_S, IntervalQueue, new_epoch, who
from .types import NO_LIMITS, FairBacklog, QueueStatus

_T = TypeVar("_T")


class StoreOptions:
    """How a command reaches the store (a URL here; the Celery app in ``celery siq``)."""

    def __init__(self, make_backend: Callable[[], Backend], resume_grace: float = RESUME_GRACE_S) -> None:
        self.make_backend = make_backend
        self.resume_grace = resume_grace
        self._backend: Backend | None = None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = self.make_backend()
        return self._backend

    def queue(self, name: str) -> IntervalQueue:
        return IntervalQueue(name, backend=self.backend)


@contextmanager
def one_line_errors() -> Iterator[None]:
    try:
        yield
    except SiqError as exc:
        raise click.ClickException(redacted(exc)) from None


class OneLineUsageError(click.UsageError):
    """A usage error as one line on stderr (click prints the usage, a hint and the error
    on four): what is wrong, and where the help is."""

    def show(self, file: Any = None) -> None:
        ctx = self.ctx
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = redacted(self.format_message()).rstrip(".")
        click.echo(f"Error: {message}{hint}", file=file, err=file is None)


@contextmanager
def _one_line_usage() -> Iterator[None]:
    try:
        yield
    except OneLineUsageError:
        raise
    except click.UsageError as exc:
        raise OneLineUsageError(exc.format_message(), exc.ctx) from None


class _OneLineUsage:
    """Usage errors of parsing and of invoking become one line (:class:`OneLineUsageError`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _one_line_usage():
            return super().parse_args(ctx, args)  # type: ignore[misc, no-any-return]

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_usage():
            return super().invoke(ctx)  # type: ignore[misc]


class SiqCommand(_OneLineUsage, click.Command):
    """A command whose usage errors are one line."""


class SiqGroup(_OneLineUsage, click.Group):
    """The ``siq`` groups: usage errors of the group and of its commands are one line."""

    command_class = SiqCommand


#: Commands whose arguments may be negative numbers ("-5s"): they reach the value's own
#: check ("must be positive") instead of being read as an unknown option.
NEGATIVE_VALUES = {"ignore_unknown_options": True}


def _when(us: int, now_us: int) -> str:
    """A store time for people: UTC, and how far from now."""
    stamp = datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
    delta = (us - now_us) / 1e6
    return f"{stamp} UTC ({'+' if delta >= 0 else ''}{delta:.3f}s)"


def _last_start(st: QueueStatus) -> str:
    """When the last start was authorized (what the ledger records), not the last slot a
    weighted start uses; '-' before the first."""
    return _when(st.state.started_us, st.now_us) if st.state.started_us else "-"


def _next_start(st: QueueStatus) -> str:
    """'paused' while paused (no start is due); 'now' when a start could be authorized at
    once (an idle queue), else when."""
    if st.state.paused:
        return "paused"
    return "now" if st.next_start_us <= st.now_us else _when(st.next_start_us, st.now_us)


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


def need_metrics_extra(command: str, module: str) -> None:
    """One line, not a traceback, when ``command`` misses its part of the metrics extra."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise click.ClickException(
            f"{command} needs {module}, which comes with the metrics extra: pip install 'siq_celery[metrics]'"
        ) from None


def _interval(_ctx: click.Context, _param: click.Parameter | None, value: str) -> int:
    return _value(parse_interval, value)


def _value(parse: Callable[..., _T], *args: Any, hint: str | None = None) -> _T:
    """``parse(*args)``, a value of the command line: one it refuses is a usage error
    (exit 2, as click's own for a bad parameter), the same for every command."""
    try:
        return parse(*args)
    except SiqError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


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


@click.command("pause", cls=SiqCommand)
@click.argument("queue")
@click.pass_obj
def pause_command(store: StoreOptions, queue: str) -> None:
    """Stop every start of QUEUE, on every worker, until resume.

    A queue no worker has created yet (pausing before a deploy) is created paused; the
    first worker's declaration sets its interval, and it stays paused until resume."""
    with one_line_errors():
        state = store.queue(queue).pause()
    waiting = no_limit_known(state)  # created here, or by an earlier pause: nothing declared yet
    click.echo(f"paused {queue}" + " (no interval yet: the first worker's declaration sets it)" * waiting)


@click.command("backoff", cls=SiqCommand, context_settings=NEGATIVE_VALUES)
@click.argument("queue")
@click.argument("duration")
@click.pass_obj
def backoff_command(store: StoreOptions, queue: str, duration: str) -> None:
    """Hold every start of QUEUE, on every worker, for DURATION (30s, 2m): the service
    said "retry after". The line keeps its order; nothing starts closer than the interval."""
    if _value(parse_duration, duration, hint="DURATION") > MAX_BACKOFF_US:
        raise click.BadParameter(f"a back-off is at most a day, not {duration!r}", param_hint="DURATION")
    with one_line_errors():
        state = store.queue(queue).backoff(duration)
        now_us = store.backend.now_us()
    click.echo(f"{queue}: held, no start before {_when(state.last_start_us + state.interval_us, now_us)}")


@click.command("resume", cls=SiqCommand)
@click.argument("queue")
@click.option("--grace", help="Restart the line this long from now (default: the longest poll of a paused waiter).")
@click.pass_obj
def resume_command(store: StoreOptions, queue: str, grace: str | None) -> None:
    """Continue QUEUE in ticket order (the first start after a short grace, so that every
    task polling the paused queue is back in time to keep its place)."""
    seconds = _value(parse_duration, grace, hint="--grace") / 1e6 if grace else store.resume_grace
    with one_line_errors():
        store.queue(queue).resume(seconds)
    click.echo(f"resumed {queue}")


@click.command("set-interval", cls=SiqCommand, context_settings=NEGATIVE_VALUES)
@click.argument("queue")
@click.argument("interval", required=False)
@click.option("--clear", is_flag=True, help="Remove the override: back to the interval the code declares.")
@click.pass_obj
def set_interval_command(store: StoreOptions, queue: str, interval: str | None, clear: bool) -> None:
    """Override QUEUE's interval at runtime (200ms, 2s, 5/s ...), from the next start.

    The override holds across worker restarts whose code declares the same interval; a
    deploy that declares another one replaces it. --clear returns to the declaration."""
    if clear == (interval is not None):
        raise click.UsageError("give an INTERVAL, or --clear (not both)")
    interval_us = None if clear else _interval(click.get_current_context(), None, interval)  # type: ignore[arg-type]
    with one_line_errors():
        state = store.queue(queue).set_interval(None if interval_us is None else interval_us / 1e6)
    if clear:
        click.echo(f"{queue}: override cleared, interval {format_interval(state.declared_interval_us)}")
    else:
        click.echo(f"{queue}: interval {format_interval(state.declared_interval_us)} (override)")


@click.command("set-limits", cls=SiqCommand, context_settings=NEGATIVE_VALUES)
@click.argument("queue")
@click.option("--burst", help="Starts that may come closer than the interval (0: strict spacing).")
@click.option("--quota", help="At most N cost units in any sliding window: 100/1m, 10000/d; none lifts it.")
@click.option("--concurrency", help="At most N bodies running at once across every node; none lifts the cap.")
@click.option("--margin", help="Added to the spacing and to the quota's window: 5ms; none (or 0) lifts it.")
@click.option("--clear", is_flag=True, help="Remove every override of the limits: back to what the code declares.")
@click.pass_obj
def set_limits_command(
    store: StoreOptions, queue: str, burst: str | None, quota: str | None, concurrency: str | None,
    margin: str | None, clear: bool,
) -> None:  # fmt: skip
    """Override QUEUE's limits at runtime, for every worker, from the next start.

    Each kind given replaces what the code declares; the others keep theirs. An override
    of a kind holds across worker restarts whose code declares the same value for it; a
    deploy that declares another replaces it. --clear returns to the declarations."""
    given = burst is not None or quota is not None or concurrency is not None or margin is not None
    if clear == given:
        raise click.UsageError("give --burst, --quota, --concurrency or --margin, or --clear (not both)")
    override = _value(limits_override, burst, quota, concurrency, margin)
    with one_line_errors():
        state = store.backend.set_limits(queue, None if clear else override, who())
    if clear:
        click.echo(f"{queue}: limits override cleared, limits {format_limits(state.limits)}")
    else:
        click.echo(f"{queue}: limits {format_limits(state.limits)} (override: {format_override(override)})")


@click.command("reset", cls=SiqCommand)
@click.argument("queue")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--interval", help="Interval to reset with (needed when the stored state is corrupt).")
@click.pass_obj
def reset_command(store: StoreOptions, queue: str, yes: bool, interval: str | None) -> None:
    """Start QUEUE's state afresh (outstanding tickets re-claim; rate cap kept).

    This is also the way out of corrupt state."""
    with one_line_errors():
        interval_us = parse_interval(interval) if interval else None
        try:
            exists = store.backend.status(queue) is not None
        except CorruptStateError:
            exists = True
            if interval_us is None:
                raise click.ClickException(f"queue {queue!r} has corrupt state: reset it with --interval") from None
        if not exists:
            raise QueueNotFoundError(f"queue {queue!r} has no state in this store")
    if not yes and not click.confirm(f"Reset queue {queue!r}? Outstanding tickets will re-claim", default=False):
        raise click.ClickException("not reset")
    with one_line_errors():
        store.backend.reset(queue, interval_us, new_epoch(), who())
    click.echo(f"reset {queue}")


@click.command("export", cls=SiqCommand)
@click.argument("queues", nargs=-1)
@click.option("--out", "-o", required=True, help="File to write (.jsonl or .parquet), or - for stdout (JSON Lines).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Default: from --out's extension (jsonl otherwise).")
@click.option("--since", help="Starts at or after: ISO time (UTC unless given), Unix seconds, or an age (2h, 7d).")
@click.option("--until", help="Starts before: same forms as --since.")
@click.option("--parked", is_flag=True, help="Write the parked tasks (JSON Lines) instead of the ledger.")
@click.pass_obj
def export_command(
    store: StoreOptions,
    queues: tuple[str, ...],
    out: str,
    fmt: str | None,
    since: str | None,
    until: str | None,
    parked: bool,
) -> None:
    """Write the ledger of QUEUES (all queues if none; glob patterns work) as JSON Lines or
    Parquet: one row per authorized start with its finish (schema: siq_celery.ledger).
    With --parked: the tasks parked beyond the horizon, one JSON object each."""
    if parked:
        with one_line_errors():
            names = _names(store, queues)
            count = write_parked(store.backend, names, out)
        click.echo(f"exported {count:,} parked tasks of {len(names)} queue(s)", err=out == "-")
        return
    since_s = _value(parse_time, since, hint="--since") if since else None
    until_s = _value(parse_time, until, hint="--until") if until else None
    with one_line_errors():
        fmt = format_for(out, fmt)
        names = _names(store, queues)
        started = time.monotonic()

        def progress(count: int) -> None:
            click.echo(f"  {count:,} rows ({time.monotonic() - started:.0f} s)", err=True)

        count = write_rows(ledger_rows(store.backend, dict.fromkeys(names), since_s, until_s), out, fmt, progress)
    where = "stdout" if out == "-" else out
    click.echo(f"exported {count:,} ledger rows of {len(names)} queue(s) to {where} ({fmt})", err=out == "-")


@click.command("exporter", cls=SiqCommand)
@click.argument("patterns", nargs=-1)
@click.option(
    "--port", default=9808, show_default=True, type=click.IntRange(1, 65535),
    help="Port of the HTTP server serving /metrics.",
)  # fmt: skip
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--max-queues",
    default=1000,
    show_default=True,
    help="Export at most this many queues (by name); the others are counted in siq_queues_left_out.",
)
@click.option(
    "--fair-top",
    default=10,
    show_default=True,
    help="Per fair queue, export the backlog of this many keys, those with the most waiting (siq_fair_key_waiting).",
)
@click.option("--once", is_flag=True, help="Print one scrape on stdout and exit (no server).")
@click.pass_obj
def exporter_command(
    store: StoreOptions, patterns: tuple[str, ...], port: int, addr: str, max_queues: int, fair_top: int, once: bool
) -> None:
    """Serve Prometheus metrics of the queues matching PATTERNS (default: all), read-only."""
    need_metrics_extra("siq exporter", "prometheus_client")
    from .observe.metrics import StoreCollector
    from .observe.metrics_http import serve, text

    if max_queues < 1:
        raise click.BadParameter(f"must be at least 1, not {max_queues}", param_hint="--max-queues")
    if fair_top < 0:
        raise click.BadParameter(f"must be 0 or more, not {fair_top}", param_hint="--fair-top")
    names: list[str] | None = None
    with one_line_errors():
        try:
            names = store.backend.queues(patterns[0] if len(patterns) == 1 else "*")
        except StoreUnavailableError as exc:
            if once:
                raise
            # Not up yet (a deploy starting everything at once): serve siq_up 0 until it
            # answers, as when it goes away later. A wrong URL is still an error here.
            click.echo(f"siq exporter: {redacted(exc)} (siq_up 0 until it answers)", err=True)
    collector = StoreCollector(store.backend, patterns or ("*",), max_queues, fair_top=fair_top)
    if once:
        click.echo(text(collector), nl=False)
        return
    try:
        server = serve(collector, port, addr)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {addr}:{port}: {exc}") from None
    now = "store not answering" if names is None else f"{len(names)} queue(s) now"
    click.echo(f"siq exporter: http://{addr}:{port}/metrics ({now}; Ctrl-C stops)", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


@click.command("top", cls=SiqCommand)
@click.argument("pattern", default="*")
@click.option("--refresh", default="1s", show_default=True, help="Time between readings.")
@click.option("--max-queues", default=200, show_default=True, help="Show at most this many queues (by name).")
@click.pass_obj
def top_command(store: StoreOptions, pattern: str, refresh: str, max_queues: int) -> None:
    """A live view of the queues matching PATTERN: rate, backlog, lateness; q quits."""
    need_metrics_extra("siq top", "rich")
    from .observe.top import run

    every = _value(parse_duration, refresh, hint="--refresh") / 1e6
    with one_line_errors():
        store.backend.queues(pattern)  # the store answers, or a clear error before the screen changes
        run(store.backend, pattern, max(every, 0.1), max_queues)


def _names(store: StoreOptions, queues: tuple[str, ...]) -> list[str]:
    names: list[str] = []
    for q in queues or ("*",):
        names += store.backend.queues(q) if any(c in q for c in "*?[") else [q]
    return list(dict.fromkeys(names))


QUEUE_COMMANDS = [
    status_command, pause_command, resume_command, backoff_command, set_interval_command, set_limits_command,
    reset_command,
    export_command, exporter_command, top_command,
]  # fmt: skip


#: ``--version`` of ``siq`` and ``celery -A app siq``.
version_option = click.version_option(__version__, "--version", prog_name="siq", message="%(prog)s %(version)s")


@click.group(cls=SiqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@click.option("--url", envvar="SIQ_URL", help="State store URL (default: $SIQ_URL).")
@click.option("--key-prefix", default=DEFAULT_KEY_PREFIX, show_default=True)
@click.pass_context
def siq(ctx: click.Context, url: str | None, key_prefix: str) -> None:
    """Operate siq_celery interval queues."""

    def make() -> Backend:
        if not url:
            raise click.ClickException("no state store: pass --url redis://host:6379/0 or set SIQ_URL")
        with one_line_errors():
            return backend_from_url(url, key_prefix=key_prefix)

    ctx.obj = StoreOptions(make)


for _command in QUEUE_COMMANDS:
    siq.add_command(_command)


@siq.command("demo", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                       "help_option_names": []})  # fmt: skip
@click.pass_context
def demo_command(ctx: click.Context) -> None:
    """Run the demo: real workers share one interval (see `siq demo --help`)."""
    from .demo import main as demo_main

    sys.exit(demo_main(list(ctx.args)))


@siq.command("audit", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                        "help_option_names": []})  # fmt: skip
@click.pass_context
def audit_command(ctx: click.Context) -> None:
    """Audit ledgers with Spark (see `siq audit --help`; needs siq_celery[spark])."""
    try:
        import pyspark.sql  # noqa: F401  (the audit imports it only once its session starts)

        from .spark.audit import main as audit_main
    except ImportError as exc:
        raise click.ClickException(f"siq audit needs PySpark: pip install 'siq_celery[spark]' ({exc})") from None
    sys.exit(audit_main(list(ctx.args), default_master="local[*]"))


def main(argv: list[str] | None = None) -> Any:
    return siq.main(args=argv, prog_name="siq")


if __name__ == "__main__":
    main()
