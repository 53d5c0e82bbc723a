"""The commands that read a store for people and monitoring: ``siq export`` of the ledger,
``siq exporter`` for Prometheus, ``siq top``."""

from __future__ import annotations

import time

import click

from ..errors import StoreUnavailableError, redacted
from ..intervals import parse_duration
from ..observe.export import FORMATS, format_for, ledger_rows, parse_time, write_parked, write_rows
from .options import SiqCommand, StoreOptions, matching_queues, need_metrics_extra, one_line_errors, param_value


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
            names = matching_queues(store, queues)
            count = write_parked(store.backend, names, out)
        click.echo(f"exported {count:,} parked tasks of {len(names)} queue(s)", err=out == "-")
        return
    since_s = param_value(parse_time, since, hint="--since") if since else None
    until_s = param_value(parse_time, until, hint="--until") if until else None
    with one_line_errors():
        fmt = format_for(out, fmt)
        names = matching_queues(store, queues)
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
    from ..observe.metrics import StoreCollector
    from ..observe.metrics_http import serve, text

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
    from ..observe.top import run

    every = param_value(parse_duration, refresh, hint="--refresh") / 1e6
    with one_line_errors():
        store.backend.queues(pattern)  # the store answers, or a clear error before the screen changes
        run(store.backend, pattern, max(every, 0.1), max_queues)
