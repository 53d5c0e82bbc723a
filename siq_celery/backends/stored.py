"""How the stores keep a queue's state and its sources: the state's fields read back
(:func:`state_from_fields`), the sources as JSON (:func:`sources_to_json`,
:func:`sources_from_json`), and queue names matched by pattern. Times in integer
microseconds on the store's clock."""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from ..errors import CorruptStateError
from ..logs import Throttle
from ..types import (
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    QueueState,
)

logger = logging.getLogger("siq_celery")
#: Unreadable interval sources are logged at most once a minute per queue (a status read
#: finds them each time until a declaration or an override writes the sources again).
_UNREADABLE_SOURCES = Throttle(60.0)


def state_from_fields(queue: str, key: str, fields: Mapping[str, Any]) -> QueueState:
    """Build a QueueState from stored fields, or raise CorruptStateError naming the field."""

    def number(name: str) -> int:
        value = fields.get(name)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise CorruptStateError(queue, key, name, value)
        try:
            return int(value)
        except ValueError:
            raise CorruptStateError(queue, key, name, value) from None

    epoch = fields.get("epoch")
    if isinstance(epoch, bytes):
        epoch = epoch.decode("utf-8", "replace")
    if not isinstance(epoch, str) or not epoch:
        raise CorruptStateError(queue, key, "epoch", epoch)
    paused = number("paused")
    state = QueueState(
        epoch=epoch,
        interval_us=number("interval_us"),
        ticket=number("ticket"),
        current=number("current"),
        anchor_us=number("anchor_us"),
        last_start_us=number("last_start_us"),
        paused=bool(paused),
    )
    if state.interval_us <= 0:
        raise CorruptStateError(queue, key, "interval_us", state.interval_us)
    if paused not in (0, 1):
        raise CorruptStateError(queue, key, "paused", paused)
    return state


def copy_state(state: QueueState) -> QueueState:
    return QueueState(**vars(state))


def sources_to_json(sources: IntervalSources) -> str:
    return json.dumps(asdict(sources), separators=(",", ":"))


def log_unreadable_sources(queue: str, where: str, unreadable: Sequence[str]) -> None:
    """Say that the queue's interval sources held what siq_celery did not write, and read
    as none: an override there is dropped (the next write of the sources drops it for good)."""
    if unreadable and _UNREADABLE_SOURCES.due((where, queue)) is not None:
        logger.warning(
            "siq_celery: queue %r: the interval sources in %s hold what siq_celery did not write (%s); read as "
            "none, so an override or declaration kept there is dropped and the queue runs at what the live "
            "workers declare. If an override was meant, set it again: `siq set-interval %s INTERVAL`",
            queue, where, "; ".join(unreadable)[:500], queue,
        )  # fmt: skip


def sources_from_json(text: str | None, queue: str = "", where: str = "") -> IntervalSources:
    """Stored sources, or none (an unreadable record only loses the override and the
    declarations, which the next worker start writes again), logged naming ``queue``
    and ``where`` it is stored."""
    if not text:
        return IntervalSources()
    try:
        raw = json.loads(text)
        override = raw.get("limits_override") or {}
        return IntervalSources(
            int(raw["declared_us"]), str(raw["declared_by"]), int(raw["declared_at_us"]),
            int(raw["override_us"]), str(raw["override_by"]), int(raw["override_at_us"]),
            tuple(
                NodeDeclaration(str(n["node"]), int(n["interval_us"]), int(n["expires_us"]), _limits(n.get("limits")))
                for n in raw["nodes"]
            ),
            _limits(raw.get("declared_limits")),
            LimitsOverride(
                _maybe_int(override.get("burst")), _maybe_int(override.get("quota")),
                int(override.get("window_us") or 0), _maybe_int(override.get("concurrency")),
                _maybe_int(override.get("margin_us")),
            ),
            str(raw.get("limits_override_by") or ""), int(raw.get("limits_override_at_us") or 0),
        )  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError):
        log_unreadable_sources(queue, where or "the store", [repr(text[:200])])
        return IntervalSources()


def _maybe_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _limits(raw: Any) -> Limits | None:
    """Stored limits (None: none stored, as a record of an earlier version has)."""
    if raw is None:
        return None
    return Limits(int(raw["burst"]), int(raw["quota"]), int(raw["window_us"]), int(raw["concurrency"]),
                  int(raw.get("margin_us") or 0))  # fmt: skip


def match_names(names: Iterator[str] | list[str], pattern: str) -> list[str]:
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))
