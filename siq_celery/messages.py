"""The ticket as it travels in a Celery message's headers.

Three flat headers (AMQP and Redis transports carry them unchanged, and they stay
readable from other languages): ``siq_queue``, ``siq_ticket``, ``siq_epoch``; a task of a
fair queue also carries its fair share, for the ledger: ``siq_fair_key``,
``siq_fair_tag`` (the virtual start tag it was handed its ticket at) and
``siq_fair_weight`` (its key's weight then). Anything
read back from a message is untrusted: a header that is missing, malformed, of another
queue, or out of range decodes to ``None`` and the task claims a fresh ticket (the store
would refuse a forged one anyway: a ticket is only ever authorized for its own queue and
epoch, and only if it was issued).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .rules import MAX_FAIR_WEIGHT
from .types import Ticket

QUEUE, TICKET, EPOCH = "siq_queue", "siq_ticket", "siq_epoch"
HEADER_NAMES = (QUEUE, TICKET, EPOCH)
#: Message header: times the task was deferred (sent back to wait), for the ledger.
DEFERRALS = "siq_deferrals"
#: Message header: deferrals in a row of a start held by a full concurrency cap (tasks/gate.py
#: waits longer each time).
HELD = "siq_held"
#: apply_async option (popped, never sent) that re-publishes with the ticket in headers.
KEEP_TICKET = "siq_keep_ticket"
_EPOCH = re.compile(r"^[0-9a-f]{1,64}\Z")  # \Z: `$` would also match before a final newline
MAX_TICKET = 2**53  # Lua numbers are doubles: beyond this tickets are not exact
#: Message headers: a fair task's key, virtual start tag and weight (for the ledger).
FAIR_KEY, FAIR_TAG, FAIR_WEIGHT = "siq_fair_key", "siq_fair_tag", "siq_fair_weight"
FAIR_HEADERS = (FAIR_KEY, FAIR_TAG, FAIR_WEIGHT)
#: No fair share: what a ledger row of a task without one records (key, tag, weight).
NO_FAIR_SHARE: tuple[str, int, int] = ("", -1, 0)


def deferrals(headers: Mapping[str, Any] | None) -> int:
    """How many times the task was sent back to wait (for the ledger; bad values count 0)."""
    value = (headers or {}).get(DEFERRALS, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31 else 0


def held(headers: Mapping[str, Any] | None) -> int:
    """Deferrals in a row held by a full concurrency cap (bad values count 0)."""
    value = (headers or {}).get(HELD, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 64 else 0


def ticket_headers(ticket: Ticket) -> dict[str, Any]:
    return {QUEUE: ticket.queue, TICKET: ticket.number, EPOCH: ticket.epoch}


def ticket_from_headers(headers: Mapping[str, Any] | None, queue: str) -> tuple[Ticket | None, str | None]:
    """The ticket carried by ``headers`` for ``queue``, or ``(None, reason)``.

    ``reason`` is None when there simply is no ticket (a message sent by name), else
    says why the ticket was not used.
    """
    if not headers or all(headers.get(name) is None for name in HEADER_NAMES):
        return None, None
    got_queue, number, epoch = (headers.get(name) for name in HEADER_NAMES)
    if got_queue != queue:
        return None, f"ticket header is for queue {got_queue!r}, not {queue!r}"
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_TICKET:
        return None, f"ticket header {number!r} is not a ticket number"
    if not isinstance(epoch, str) or not _EPOCH.match(epoch):
        return None, f"epoch header {epoch!r} is malformed"
    return Ticket(queue, number, epoch, 0, 0), None


def with_fair_share(message: str, key: str, tag: int, weight: int) -> str:
    """A fair task's parked message (a JSON object) as the promotion that handed it its
    ticket rewrites it: ``{"fair": [key, tag, weight], ...`` in front (release.lua does the
    same in Lua); :func:`fair_share` reads it back at release."""
    if not message.startswith("{"):
        return message  # not a parked message: the release reports it unreadable
    rest = message[1:]
    share = json.dumps([key, tag, weight])
    return f'{{"fair": {share}{"" if rest.lstrip().startswith("}") else ","} {rest}'


def fair_share(value: Any) -> tuple[str, int, int]:
    """A parked message's ``"fair"`` field as (key, tag, weight); ValueError saying what is
    off (the store is outside this process: never trusted)."""
    if (
        isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and value[0]
        and _whole(value[1], 0, MAX_TICKET) and _whole(value[2], 1, MAX_FAIR_WEIGHT)
    ):  # fmt: skip
        return value[0], value[1], value[2]
    raise ValueError(f"malformed fair share {str(value)[:200]!r}: not [key, tag >= 0, weight 1..{MAX_FAIR_WEIGHT}]")


def fair_headers(key: str, tag: int, weight: int) -> dict[str, Any]:
    return {FAIR_KEY: key, FAIR_TAG: tag, FAIR_WEIGHT: weight}


def fair_from_headers(headers: Mapping[str, Any] | None) -> tuple[str, int, int]:
    """The fair share a task's headers carry, (key, tag, weight); :data:`NO_FAIR_SHARE`
    when they carry none or a malformed one (for the ledger only: nothing else reads it)."""
    headers = headers or {}
    try:
        return fair_share([headers.get(FAIR_KEY), headers.get(FAIR_TAG), headers.get(FAIR_WEIGHT)])
    except ValueError:
        return NO_FAIR_SHARE


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
