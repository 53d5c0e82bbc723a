"""``celery -A app siq ...``: the ``siq`` commands on the app's own state store.

Registered through the ``celery.commands`` entry point (``siq``, given by ``__getattr__``
below), so it appears once siq_celery is installed. The store is the one the app's tasks use
(``siq_url``, or the Redis broker).
"""

from __future__ import annotations

from typing import Any

import click

from ..broker.transit import guard_transit
from ..intervals import format_interval
from ..tasks.app_state import siq_state
from ..tasks.declarations import describe, sync_app
from .main import QUEUE_COMMANDS, version_option
from .options import SiqGroup, StoreOptions, one_line_errors


@click.group(name="siq", cls=SiqGroup)
@version_option
@click.pass_context
def _siq(ctx: click.Context) -> None:
    """Operate the app's interval queues (status, pause, resume, set-interval, set-limits, sync, reset)."""
    app = ctx.obj.app
    ctx.meta["siq_app"] = app

    def make():  # type: ignore[no-untyped-def]
        with one_line_errors():
            return siq_state(app).backend

    # Tasks of a paused queue look again every siq_paused_poll: resume after that long.
    with one_line_errors():
        grace = siq_state(app).settings.paused_poll
    ctx.obj = StoreOptions(make, resume_grace=grace)


for _command in QUEUE_COMMANDS:
    _siq.add_command(_command)


@_siq.command("sync")
@click.pass_context
def sync_command(ctx: click.Context) -> None:
    """Make the app's code the declaration of its queues, as a worker start does (for
    scripts and producers that run no worker): a changed interval= takes effect now,
    replacing any override. Live workers still hold a queue to their slowest declaration."""
    app: Any = ctx.meta["siq_app"]
    with one_line_errors():
        results = sync_app(app)
    if not results:
        click.echo("no interval tasks with a fixed queue in this app")
    for name, done in results:
        line = describe(name, done, "siq sync")
        click.echo(line or f"queue {name!r}: interval {format_interval(done.interval_us)} as declared")


def __getattr__(name: str) -> Any:
    """``siq``: the command group as the ``celery`` command loads it (its
    ``celery.commands`` entry point), at the start of every ``celery`` command. Loading it
    puts the transit guard on kombu's Redis transport (broker/transit.py), so that
    ``celery -A app purge``, which binds no task, drops the transit records of what it
    purged and a worker's sweep does not put it back. Importing this module installs
    nothing (the guard changes only messages of interval tasks)."""
    if name == "siq":
        guard_transit()
        return _siq
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
