"""The ticket as it travels in a Celery message's headers.

Three flat headers (AMQP and Redis transports carry them unchanged, and they stay
readable from other languages): ``siq_queue``, ``siq_ticket``, ``siq_epoch``. Anything
read back from a message is untrusted: a header that is missing, malformed, of another
queue, or out of range decodes to ``None`` and the task claims a fresh ticket (the store
would refuse a forged one anyway: a ticket is only ever authorized for its own queue and
epoch, and only if it was issued).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .types import Ticket

QUEUE, TICKET, EPOCH = "siq_queue", "siq_ticket", "siq_epoch"
HEADER_NAMES = (QUEUE, TICKET, EPOCH)
#: Message header: times the task was deferred (sent back to wait), for the ledger.
DEFERRALS = "siq_deferrals"
#: apply_async option (popped, never sent) that re-publishes with the ticket in headers.
KEEP_TICKET = "siq_keep_ticket"
_EPOCH = re.compile(r"^[0-9a-f]{1,64}\Z")  # \Z: `$` would also match before a final newline
MAX_TICKET = 2**53  # Lua numbers are doubles: beyond this tickets are not exact


def deferrals(headers: Mapping[str, Any] | None) -> int:
    """How many times the task was sent back to wait (for the ledger; bad values count 0)."""
    value = (headers or {}).get(DEFERRALS, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31 else 0


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
