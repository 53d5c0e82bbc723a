"""Fair shares among keys under one limit: start-time fair queuing (docs/design.md,
"Fair shares"). Each key with waiting work has the virtual start tag of its head; the
next ticket of the shared queue goes to the head of the key with the smallest tag (ties:
the smaller key), which moves the queue's virtual time to that tag and the key's tag on by
its task's cost over its weight. A key that had no work rejoins at the virtual time (no
credit for its idle time), or at its last finish tag if it was served so recently that the
virtual time has not reached it (no jumping ahead by emptying and refilling). Virtual time
counts :data:`FAIR_SCALE` per cost unit of weight 1: integers, exact in Lua doubles.

Twin: ``fair.lua`` beside this module."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from ..types import QueueState
from .spacing import outage_us
from .tickets import claim, slot_of
from .window import Window

FAIR_SCALE = 720_720  # lcm(1..16): weights 1 to 16 advance tags by whole numbers


MAX_FAIR_WEIGHT = 1_000


class FairLines(Protocol):
    """A fair queue's waiting work by key. A store keeps it beside the queue's state (Redis:
    a sorted set of active keys by tag, one of recent finish tags, a list per key; SQLite:
    tables; memory: :class:`DictFairLines`)."""

    def vtime(self) -> int:
        """The queue's virtual time: the tag of the last head handed a ticket."""

    def set_vtime(self, vtime: int) -> None: ...

    def head_tag(self, key: str) -> int | None:
        """The start tag of ``key``'s head (None: the key has no waiting work)."""

    def smallest(self) -> tuple[int, str] | None:
        """(tag, key) of the active key with the smallest tag (ties: the smaller key)."""

    def set_head_tag(self, key: str, tag: int | None) -> None:
        """``key`` active at ``tag``, or (None) inactive."""

    def finish_tag(self, key: str) -> int | None:
        """The finish tag of ``key``'s last head handed a ticket, while kept."""

    def set_finish_tag(self, key: str, tag: int) -> None: ...

    def largest_finish_tag(self) -> int | None:
        """The largest finish tag kept (None: none)."""

    def forget_finish_tags(self, through: int) -> None:
        """Forget the finish tags at or below ``through`` (the virtual time reached them)."""

    def push(self, key: str, task_id: str, cost: int, weight: int) -> None:
        """Append a task to ``key``'s line (``weight``: the key's, from now on)."""

    def pop(self, key: str) -> tuple[str, int, int]:
        """Take ``key``'s head: (task id, cost, the key's weight)."""

    def waiting(self, key: str) -> int:
        """Tasks in ``key``'s line."""


class DictFairLines:
    """:class:`FairLines` in memory (the memory store's, and the reference's). The smallest
    head and the finish tags to forget are found in heaps, so neither gets slower with the
    number of keys (an entry a key's newer tag replaced is dropped when it comes up)."""

    def __init__(self) -> None:
        self.v = 0
        self.heads: dict[str, int] = {}
        self.finishes: dict[str, int] = {}
        self.lines: dict[str, deque[tuple[str, int]]] = {}
        self.weights: dict[str, int] = {}
        self._head_heap: list[tuple[int, str]] = []
        self._finish_heap: list[tuple[int, str]] = []

    def vtime(self) -> int:
        return self.v

    def set_vtime(self, vtime: int) -> None:
        self.v = vtime

    def head_tag(self, key: str) -> int | None:
        return self.heads.get(key)

    def smallest(self) -> tuple[int, str] | None:
        heap = self._head_heap
        while heap and self.heads.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def set_head_tag(self, key: str, tag: int | None) -> None:
        if tag is None:
            self.heads.pop(key, None)
        else:
            self.heads[key] = tag
            heapq.heappush(self._head_heap, (tag, key))

    def finish_tag(self, key: str) -> int | None:
        return self.finishes.get(key)

    def set_finish_tag(self, key: str, tag: int) -> None:
        self.finishes[key] = tag
        heapq.heappush(self._finish_heap, (tag, key))

    def largest_finish_tag(self) -> int | None:
        return max(self.finishes.values(), default=None)

    def forget_finish_tags(self, through: int) -> None:
        heap = self._finish_heap
        while heap and heap[0][0] <= through:
            tag, key = heapq.heappop(heap)
            if self.finishes.get(key) == tag:
                del self.finishes[key]

    def push(self, key: str, task_id: str, cost: int, weight: int) -> None:
        self.lines.setdefault(key, deque()).append((task_id, cost))
        self.weights[key] = weight

    def pop(self, key: str) -> tuple[str, int, int]:
        task_id, cost = self.lines[key].popleft()
        weight = self.weights[key]
        if not self.lines[key]:
            del self.lines[key], self.weights[key]
        return task_id, cost, weight

    def waiting(self, key: str) -> int:
        return len(self.lines.get(key, ()))


def fair_check(key: str, weight: int, costs: Sequence[int]) -> None:
    """ValueError unless every cost is 1 or more and the weight is 1..MAX_FAIR_WEIGHT."""
    for cost in costs:
        if cost < 1 or not 1 <= weight <= MAX_FAIR_WEIGHT:
            raise ValueError(f"fair share of {key!r}: cost {cost} must be >= 1, weight {weight} 1..{MAX_FAIR_WEIGHT}")
    if not 1 <= weight <= MAX_FAIR_WEIGHT:
        raise ValueError(f"fair share of {key!r}: weight {weight} must be 1..{MAX_FAIR_WEIGHT}")


def fair_push(lines: FairLines, key: str, task_id: str, cost: int, weight: int) -> None:
    """A task of ``key`` waits for its share; a key with no work before joins now. (A cost
    of 0 would never move its key's tag, and a weight of 0 has no share: both refused.)"""
    fair_check(key, weight, [cost])
    if lines.head_tag(key) is None:
        lines.set_head_tag(key, max(lines.vtime(), lines.finish_tag(key) or 0))
    lines.push(key, task_id, cost, weight)


class FairTurn(NamedTuple):
    """A task handed the shared queue's next ticket (:func:`fair_next`): its key, id and
    cost, the virtual start tag it was served at and its key's weight (the last two go
    with it to the ledger, for the audit: see :func:`siq_celery.messages.with_fair_share`)."""

    key: str
    task_id: str
    cost: int
    tag: int
    weight: int


def fair_next(lines: FairLines) -> FairTurn | None:
    """The next task to hand a ticket of the shared queue, taken from its line (None: no
    key has work). The tags served are nondecreasing until no key has work left, when the
    virtual time starts over from 0 (what the audit checks)."""
    head = lines.smallest()
    if head is None:
        return None
    tag, key = head
    task_id, cost, weight = lines.pop(key)
    finish = tag + cost * FAIR_SCALE // weight
    lines.set_finish_tag(key, finish)
    lines.set_head_tag(key, finish if lines.waiting(key) else None)
    # The virtual time moves to the tag served. When no key has work left (SFQ's idle
    # rule: every key rejoins even), nothing is kept and it starts over from 0, so tags
    # stay far below 2**53 (Lua's exact integers) whatever the queue's age.
    if lines.smallest() is None:
        lines.forget_finish_tags(max(tag, lines.largest_finish_tag() or 0))
        lines.set_vtime(0)
    else:
        lines.set_vtime(tag)
        lines.forget_finish_tags(tag)
    return FairTurn(key, task_id, cost, tag, weight)


#: How far ahead a fair queue hands out its tickets: about this much of its slots, at
#: least FAIR_LOOKAHEAD_MIN and at most FAIR_LOOKAHEAD_MAX tickets (a queue without spacing,
#: whose interval is 1 µs, or one at a fraction of a millisecond), and with a concurrency
#: cap at most the cap and FAIR_LOOKAHEAD_MIN more. A key that arrives gets a ticket within
#: the lookahead; a longer one would only delay it.
FAIR_LOOKAHEAD_US = 250_000


FAIR_LOOKAHEAD_MIN = 4


FAIR_LOOKAHEAD_MAX = 64


def fair_lookahead(interval_us: int, concurrency: int = 0) -> int:
    """Tickets a fair queue keeps handed out ahead of its starts."""
    ahead = min(FAIR_LOOKAHEAD_MAX, max(FAIR_LOOKAHEAD_MIN, -(-FAIR_LOOKAHEAD_US // max(interval_us, 1))))
    return min(ahead, concurrency + FAIR_LOOKAHEAD_MIN) if concurrency else ahead


def fair_room(state: QueueState, now_us: int) -> int:
    """How many more tickets a fair queue may hand out now: the lookahead less the tickets
    handed out and not yet started. Those that will never start (a revoked or expired task,
    a lost message, a duplicate) would hold the lookahead forever: once the newest ticket's
    slot is more than :func:`outage_us` past with none of them started since, a whole
    lookahead more goes out (at most once per outage span, as the newest slot then moves)."""
    ahead = fair_lookahead(state.interval_us, state.concurrency)
    handed = state.ticket - state.current
    if handed > 0 and max(slot_of(state, state.ticket), state.last_start_us) + outage_us(state.interval_us) < now_us:
        return ahead
    return ahead - handed


def fair_promote(
    state: QueueState, lines: FairLines, now_us: int, window: Window | None = None
) -> list[tuple[int, FairTurn]]:
    """Hand tickets of the shared queue to the fair heads, in fair order, while fewer than
    the lookahead are handed out and not yet started; (first ticket, turn) of each (a
    task of cost c takes c tickets, as its claim would). None while paused: a key that
    arrives during a pause gets its share when the queue resumes."""
    promoted: list[tuple[int, FairTurn]] = []
    if state.paused:
        return promoted
    room = fair_room(state, now_us)
    while room > 0:
        head = fair_next(lines)
        if head is None:
            break
        promoted.append((claim(state, head.cost, now_us, window).first, head))
        room -= head.cost
    return promoted
