"""What the ``siq`` commands share: the store option, one-line errors, values parsed
as a click parameter error."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from ..backends import Backend
from ..client.control import RESUME_GRACE_S
from ..client.queue import IntervalQueue
from ..errors import SiqError, redacted
from ..intervals import parse_interval

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


def need_metrics_extra(command: str, module: str) -> None:
    """One line, not a traceback, when ``command`` misses its part of the metrics extra."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise click.ClickException(
            f"{command} needs {module}, which comes with the metrics extra: pip install 'siq_celery[metrics]'"
        ) from None


def interval_param(_ctx: click.Context, _param: click.Parameter | None, value: str) -> int:
    return param_value(parse_interval, value)


def param_value(parse: Callable[..., _T], *args: Any, hint: str | None = None) -> _T:
    """``parse(*args)``, a value of the command line: one it refuses is a usage error
    (exit 2, as click's own for a bad parameter), the same for every command."""
    try:
        return parse(*args)
    except SiqError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def matching_queues(store: StoreOptions, queues: tuple[str, ...]) -> list[str]:
    names: list[str] = []
    for q in queues or ("*",):
        names += store.backend.queues(q) if any(c in q for c in "*?[") else [q]
    return list(dict.fromkeys(names))


def when_text(us: int, now_us: int) -> str:
    """A store time for people: UTC, and how far from now."""
    stamp = datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
    delta = (us - now_us) / 1e6
    return f"{stamp} UTC ({'+' if delta >= 0 else ''}{delta:.3f}s)"
