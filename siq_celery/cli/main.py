"""The ``siq`` group: its store options, its commands, ``siq demo`` and ``siq audit``."""

from __future__ import annotations

import sys
from typing import Any

import click

from .. import __version__
from ..backends import Backend, backend_from_url
from ..keys import DEFAULT_KEY_PREFIX
from .observe_commands import export_command, exporter_command, top_command
from .options import SiqGroup, StoreOptions, one_line_errors
from .queue_commands import (
    backoff_command,
    pause_command,
    reset_command,
    resume_command,
    set_interval_command,
    set_limits_command,
)
from .status import status_command

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
    from ..demo import main as demo_main

    sys.exit(demo_main(list(ctx.args)))


@siq.command("audit", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                        "help_option_names": []})  # fmt: skip
@click.pass_context
def audit_command(ctx: click.Context) -> None:
    """Audit ledgers with Spark (see `siq audit --help`; needs siq_celery[spark])."""
    try:
        import pyspark.sql  # noqa: F401  (the audit imports it only once its session starts)

        from ..spark.audit import main as audit_main
    except ImportError as exc:
        raise click.ClickException(f"siq audit needs PySpark: pip install 'siq_celery[spark]' ({exc})") from None
    sys.exit(audit_main(list(ctx.args), default_master="local[*]"))


def main(argv: list[str] | None = None) -> Any:
    return siq.main(args=argv, prog_name="siq")
