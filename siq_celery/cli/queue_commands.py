"""The commands that change a queue: pause, back off, resume, set its interval or limits,
reset it."""

from __future__ import annotations

import click

from ..client.control import new_epoch, who
from ..errors import CorruptStateError, QueueNotFoundError
from ..intervals import MAX_BACKOFF_US, format_interval, parse_duration, parse_interval
from ..limits import format_limits, format_override, limits_override
from ..rules import no_limit_known
from .options import NEGATIVE_VALUES, SiqCommand, StoreOptions, interval_param, one_line_errors, param_value, when_text


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
    if param_value(parse_duration, duration, hint="DURATION") > MAX_BACKOFF_US:
        raise click.BadParameter(f"a back-off is at most a day, not {duration!r}", param_hint="DURATION")
    with one_line_errors():
        state = store.queue(queue).backoff(duration)
        now_us = store.backend.now_us()
    click.echo(f"{queue}: held, no start before {when_text(state.last_start_us + state.interval_us, now_us)}")


@click.command("resume", cls=SiqCommand)
@click.argument("queue")
@click.option("--grace", help="Restart the line this long from now (default: the longest poll of a paused waiter).")
@click.pass_obj
def resume_command(store: StoreOptions, queue: str, grace: str | None) -> None:
    """Continue QUEUE in ticket order (the first start after a short grace, so that every
    task polling the paused queue is back in time to keep its place)."""
    seconds = param_value(parse_duration, grace, hint="--grace") / 1e6 if grace else store.resume_grace
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
    interval_us = None if clear else interval_param(click.get_current_context(), None, interval)  # type: ignore[arg-type]
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
    override = param_value(limits_override, burst, quota, concurrency, margin)
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
