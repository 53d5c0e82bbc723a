"""``celery -A app siq ...``: the ``siq`` commands on the app's own state store.

Registered through the ``celery.commands`` entry point, so it appears once siq_celery is
installed. The store is the one the app's tasks use (``siq_url``, or the Redis broker).
"""

from __future__ import annotations

import click

from .cli import QUEUE_COMMANDS, StoreOptions, one_line_errors
from .config import siq_state


@click.group(name="siq")
@click.pass_context
def siq(ctx: click.Context) -> None:
    """Operate the app's interval queues (status, pause, resume, set-interval, reset)."""
    app = ctx.obj.app

    def make():  # type: ignore[no-untyped-def]
        with one_line_errors():
            return siq_state(app).backend

    # Tasks of a paused queue look again every siq_paused_poll: resume after that long.
    with one_line_errors():
        grace = siq_state(app).settings.paused_poll
    ctx.obj = StoreOptions(make, resume_grace=grace)


for _command in QUEUE_COMMANDS:
    siq.add_command(_command)
