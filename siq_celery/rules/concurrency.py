"""Concurrency: at most ``concurrency`` bodies running at once, counted over the queue's
:class:`Leases`, and the run lease that keeps a live task from running twice.

Three leases, three names (docs/design.md, "The model"):

* the **run lease**: named by a task id, taken by its start, renewed while the body runs,
  given back by its finish: a copy of a running task is answered RUNNING
  (:func:`running_copy`), and a start whose reply was lost is given again to its own call
  (:func:`own_start`, :class:`RunOwner`);
* the **concurrency lease**: one per running body of a queue with a cap (a start with a
  task id uses its run lease for it): a start whose slot came while the cap is full waits
  (:func:`read_leases`, :func:`lease_wait`), and a line the cap held is due from the
  release (:func:`release_shift`); the tickets ahead keep their claims (:func:`lease_turn`);
* the **release lease** a releaser holds on the parked tasks it publishes lives with parking
  (``Backend.release``, called by ``tasks/parking.py``), not here.

Twin: ``concurrency.lua`` beside this module. Times in integer microseconds, store's clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from ..types import QueueState
from .tickets import FREE, slot_of


class RunOwner(NamedTuple):
    """Who took a run's lease: the ``token`` of the call that asked (one per wait_in_line
    call, sent with each of its asks), and the start it was given (store time and slot; a
    start of several queues: the latest of their slots). A call whose reply was lost asks
    again and is given that start again (:func:`own_start`)."""

    token: str
    now_us: int
    slot_us: int


class Leases(Protocol):
    """The leases of a queue: member -> expiry (store time), one per running body. A start
    with a task id takes one named by its task id (a copy of it is not started while that
    lease is live: :func:`running_copy`); a start without one takes one only under a
    concurrency cap, which counts them all. A store keeps them apart from the state (Redis: a sorted set in the
    queue's hash tag; SQLite: a table; memory: :class:`DictLeases`)."""

    def count(self) -> int:
        """Leases kept (expired ones not yet trimmed included)."""

    def trim(self, now_us: int) -> list[int]:
        """Forget the leases that expired (expiry <= now); their expiries, oldest first."""

    def earliest(self) -> int | None:
        """The earliest expiry kept (None: none)."""

    def add(self, member: str, expires_us: int) -> None:
        """Take ``member``'s lease (with no owner: :meth:`set_owner`)."""

    def expires(self, member: str) -> int | None:
        """When ``member``'s lease expires (None: not kept)."""

    def remove(self, member: str) -> bool:
        """Give back ``member``'s lease (and its owner); whether it was kept."""

    def owner(self, member: str) -> RunOwner | None:
        """Who took ``member``'s lease (None: not known, or not kept). :meth:`trim` forgets
        the owners of the leases it forgets."""

    def set_owner(self, member: str, owner: RunOwner) -> None: ...

    def renew(self, members: Sequence[str], expires_us: int) -> int:
        """Move the expiry of those of ``members`` kept to ``expires_us`` (never adds one);
        how many were kept."""

    def live(self, now_us: int) -> int:
        """Leases not expired at ``now_us`` (read only)."""


class DictLeases:
    """:class:`Leases` in memory (the memory store's)."""

    def __init__(self) -> None:
        self.expiry: dict[str, int] = {}
        self.owners: dict[str, RunOwner] = {}

    def count(self) -> int:
        return len(self.expiry)

    def trim(self, now_us: int) -> list[int]:
        gone = sorted(e for e in self.expiry.values() if e <= now_us)
        if gone:
            self.expiry = {m: e for m, e in self.expiry.items() if e > now_us}
            self.owners = {m: o for m, o in self.owners.items() if m in self.expiry}
        return gone

    def earliest(self) -> int | None:
        return min(self.expiry.values(), default=None)

    def add(self, member: str, expires_us: int) -> None:
        self.expiry[member] = expires_us
        self.owners.pop(member, None)

    def expires(self, member: str) -> int | None:
        return self.expiry.get(member)

    def remove(self, member: str) -> bool:
        self.owners.pop(member, None)
        return self.expiry.pop(member, None) is not None

    def owner(self, member: str) -> RunOwner | None:
        return self.owners.get(member)

    def set_owner(self, member: str, owner: RunOwner) -> None:
        self.owners[member] = owner

    def renew(self, members: Sequence[str], expires_us: int) -> int:
        kept = [m for m in set(members) if m in self.expiry]
        for m in kept:
            self.expiry[m] = expires_us
        return len(kept)

    def live(self, now_us: int) -> int:
        return sum(1 for e in self.expiry.values() if e > now_us)


#: While the concurrency cap is full, a start whose slot came is told to ask again after this
#: (or at the earliest lease expiry, if sooner): a finish frees a lease at a time no one knows.
LEASE_POLL_US = 10_000


#: A ticket whose slot came keeps its claim on a free lease this long after its slot (after
#: the release, for a line the full cap held): the tickets behind it take no lease it needs
#: meanwhile. Twice the poll of a start the full cap holds, so the head asks in time even
#: when its poll comes a round trip or a scheduling delay late.
LEASE_GRACE_US = 2 * LEASE_POLL_US


def release_shift(state: QueueState, at_us: int) -> None:
    """A lease came back at ``at_us`` while the cap was full: if the head of the line was
    due before then, the cap held it, and the line is due from the release (the anchor
    moves so the head's slot is ``at_us``). A head the cap held is not late: the line
    behind keeps its spacing from the release, so a later ticket whose slot passed
    meanwhile does not take the freed lease ahead of it, and no outage shift follows."""
    if state.ticket > state.current and state.anchor_us + state.interval_us < at_us:
        state.anchor_us = at_us - state.interval_us


def read_leases(state: QueueState | None, leases: Leases | None, now_us: int) -> int:
    """The live leases at ``now_us`` (mutates ``leases``, and ``state`` through
    :func:`release_shift`): the expired ones are forgotten; if that brought a full cap
    below it, the release happened at the expiry that did."""
    if leases is None:
        return 0
    before = leases.count()
    if not before:
        return 0
    gone = leases.trim(now_us)
    n = state.concurrency if state is not None else 0
    if state is not None and n and gone and before >= n > before - len(gone):
        release_shift(state, gone[before - n])
    return before - len(gone)


def lease_turn(state: QueueState, ticket: int, live: int) -> int:
    """When ``ticket`` may take one of the free leases, as far as the tickets ahead of it in
    line go (0: now). Each ticket ahead (``current + 1 .. ticket - 1``) keeps a claim on a
    lease until :data:`LEASE_GRACE_US` after its slot; ``ticket`` may take a lease only if
    one is left over for each claim still held (``live``: the leases taken). So a lease freed
    while the cap was full goes to the head of the line, which polls every
    :data:`LEASE_POLL_US`, not to a later ticket that asks first; a ticket that never asks
    holds a lease back for the grace, no more. A ticket passed over (``<= current``) or
    :data:`FREE` has no place in the line and no one ahead of it."""
    ahead = ticket - state.current - 1
    if not state.concurrency or ticket == FREE or ahead <= 0:
        return 0
    claims = ahead - (state.concurrency - live - 1)  # claims beyond the leases left over: must lapse first
    if claims <= 0:
        return 0
    return slot_of(state, state.current + claims) + LEASE_GRACE_US


def lease_wait(leases: Leases, now_us: int) -> int:
    """How long a start held by a full cap waits before asking again (at least 1 µs)."""
    earliest = leases.earliest()
    return max(min(LEASE_POLL_US, (earliest if earliest is not None else now_us + LEASE_POLL_US) - now_us), 1)


def give_back(state: QueueState | None, leases: Leases, member: str, now_us: int) -> bool:
    """The end of a body gives its lease back (a finish of any kind, in the finish's own
    step); whether it was kept. A full cap's release shifts the line (:func:`release_shift`)."""
    count = read_leases(state, leases, now_us)
    kept = leases.remove(member)
    if kept and state is not None and state.concurrency and count >= state.concurrency:
        release_shift(state, now_us)
    return kept


def renew_leases(state: QueueState | None, leases: Leases, members: Sequence[str], now_us: int, lease_us: int) -> int:
    """The bodies of ``members`` still run: their leases now expire ``lease_us`` from now
    (those already expired and forgotten are not taken again); how many were renewed."""
    read_leases(state, leases, now_us)
    return leases.renew(members, now_us + lease_us)


def too_many_lost(unfinished: int, max_lost: int) -> bool:
    """Whether a task id is refused as a poison message: ``unfinished`` counts its
    authorized starts since its last finish of any kind (success, failure, a retry's, a
    back-off's), each one a delivery lost with its worker process (or a copy still
    running); at ``max_lost`` of them it is not started again (0: no limit). The count is
    kept as long as finished records are, and goes with the queue's state."""
    return 0 < max_lost <= unfinished


def running_copy(leases: Leases | None, task_id: str | None, now_us: int) -> int:
    """The expiry of the live lease of a run of ``task_id`` (0: none). A start takes a lease
    named by its task id, renewed while its body runs and given back by its finish, so a
    live one means a copy of this task still runs (or its process died less than
    ``siq_lease_timeout`` ago): another copy (a redelivery, a broker's visibility timeout
    passed) is not started now but answered RUNNING, and asks again at the expiry."""
    if leases is None or not task_id:
        return 0
    expires = leases.expires(task_id)
    return expires if expires is not None and expires > now_us else 0


def own_start(leases: Leases | None, task_id: str | None, token: str, now_us: int) -> RunOwner | None:
    """The start the call holding ``token`` was given already: the live lease of a run of
    ``task_id`` taken by that call (None: none). Its reply was lost on the way back and it
    asks again (the store unreachable to it, a timeout): it adopts that start, and is not
    answered RUNNING by its own lease, which only another delivery of the task is."""
    if not token or not running_copy(leases, task_id, now_us):
        return None
    assert leases is not None and task_id
    owner = leases.owner(task_id)
    return owner if owner is not None and owner.token == token else None


def _live(state: QueueState, leases: Leases | None, now_us: int) -> int:
    """The live leases at ``now_us`` of a queue with a concurrency cap, 0 without one
    (reads the leases: :func:`read_leases`)."""
    return read_leases(state, leases, now_us) if state.concurrency and leases is not None else 0
