"""A store that runs the rules (:mod:`siq_celery.rules`) inside a transaction of its own:
:class:`ModelBackend` implements every operation of :class:`~siq_celery.backends.base.Backend`
once, over a :class:`Transaction` (one queue's state, window, leases, ledger, parked and fair
lines) that each store (memory, SQLite) provides. Times in integer microseconds on the
store's clock."""

from __future__ import annotations

import contextlib
import secrets
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

from .. import rules
from ..errors import QueueNotFoundError
from ..ledger import LedgerRow, StartRecord
from ..messages import with_fair_share
from ..parked import FairBacklog, FairTask, ParkedTask, Release
from ..types import NO_LIMITS, ClaimResult, Decision, Declared, Limits, LimitsOverride, QueueState, QueueStatus
from .base import REFUSALS, RELEASE_LEASE_US, RELEASE_LIMIT, Backend, check_top, no_interval_yet
from .stored import copy_state
from .transaction import Transaction


class ModelBackend(Backend):
    """A backend that runs :mod:`siq_celery.rules` on state loaded inside a transaction.

    Subclasses provide :meth:`transactions` (load, yield, write back on success; several
    queues at once for a start with several limits) and :meth:`queues`; every operation
    is then implemented once, here.
    """

    def _woke(self, queue: str, next_ticket: int, now_us: int) -> None:
        """A wake of ``queue`` (:meth:`wait_for_wake`), inside the step that freed the line:
        the memory store's waiters are woken; others poll."""

    @abstractmethod
    def transactions(
        self, queues: Sequence[str], *, replace_corrupt: bool = False
    ) -> AbstractContextManager[list[Transaction]]:
        """Lock the queues' states together, yield one transaction each, and write every
        ``tx.state`` back on a clean exit (nothing on an error).

        Corrupt stored state raises CorruptStateError, unless ``replace_corrupt`` (used by
        reset, the way out of corruption) makes it load as missing."""

    @contextlib.contextmanager
    def transaction(self, queue: str, *, replace_corrupt: bool = False) -> Iterator[Transaction]:
        """:meth:`transactions` of one queue."""
        with self.transactions([queue], replace_corrupt=replace_corrupt) as (tx,):
            yield tx

    @contextlib.contextmanager
    def _following(self, queues: Sequence[str], *, replace_corrupt: bool = False) -> Iterator[list[Transaction]]:
        """:meth:`transactions` whose states' interval follows the expiry of node
        declarations (:func:`siq_celery.rules.follow_expiry`): for the operations that
        decide by the interval."""
        with self.transactions(queues, replace_corrupt=replace_corrupt) as txs:
            for tx in txs:
                if tx.state is not None:
                    followed = rules.follow_expiry(tx.state, tx.sources(), tx.now_us)
                    if followed is not None:
                        tx.save_sources(followed)
            yield txs

    @contextlib.contextmanager
    def _following_one(self, queue: str, *, replace_corrupt: bool = False) -> Iterator[Transaction]:
        with self._following([queue], replace_corrupt=replace_corrupt) as (tx,):
            yield tx

    def ensure(
        self, queue: str, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> tuple[QueueState, bool]:
        with self.transaction(queue) as tx:
            if tx.state is not None:
                return copy_state(tx.state), False
            tx.state = _new_state(tx, interval_us, epoch, limits)
            return copy_state(tx.state), True

    def _created(
        self, tx: Transaction, queue: str, interval_us: int, epoch: str, limits: Limits = NO_LIMITS
    ) -> QueueState:
        if tx.state is None:
            if interval_us <= 0:
                raise QueueNotFoundError(f"queue {queue!r} has no state in this store and no interval was given")
            tx.state = _new_state(tx, interval_us, epoch, limits)
        return tx.state

    @staticmethod
    def _window(tx: Transaction, state: QueueState) -> rules.Window | None:
        return tx.window() if state.quota else None

    def _lease_taken(
        self, states: Sequence[QueueState], task_id: str | None, member: str, now_us: int
    ) -> tuple[str, int] | None:
        """The lease a start takes if authorized: its run's, named by its task id (a copy is
        not started while it is live: rules.running_copy), or, without a task id, one only
        under a concurrency cap (in any of ``states``)."""
        taken = task_id or any(state.concurrency for state in states)
        return (member, now_us + self.lease_timeout_us) if taken else None

    @staticmethod
    def _is_run(task_id: str | None, member: str) -> bool:
        """Whether a start's lease ``member`` is its run's (named by its task id)."""
        return bool(task_id) and member == task_id

    @classmethod
    def _run_token(cls, task_id: str | None, member: str, token: str) -> str:
        """The token kept as the owner of a start's lease: only the run's."""
        return token if cls._is_run(task_id, member) else ""

    def claim(self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS) -> ClaimResult:
        with self._following_one(queue) as tx:
            state = self._created(tx, queue, interval_us, epoch, limits)
            return rules.claim(state, count, tx.now_us, self._window(tx, state))

    def start(
        self,
        queue: str,
        ticket: int,
        epoch: str,
        *,
        task_id: str | None,
        interval_us: int,
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Limits = NO_LIMITS,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> Decision:
        member = self.lease_member(task_id, record, lease)
        with self._following_one(queue) as tx:
            state = self._created(tx, queue, interval_us, new_epoch, limits)
            finished = task_id is not None and tx.is_finished(task_id)
            lost = self._lost(tx, task_id)
            leases = tx.leases()
            token = self._run_token(task_id, member, token)
            own = rules.own_start(leases, task_id, token, tx.now_us)
            decision = rules.start(
                state, ticket, epoch, tx.now_us, finished=finished, cost=cost, lost=lost,
                window=self._window(tx, state), leases=leases,
                lease=self._lease_taken([state], task_id, member, tx.now_us),
                running_us=rules.running_copy(leases, task_id, tx.now_us), token=token, own=own,
                begin_wait_us=begin_wait_us,
            )  # fmt: skip
            if own is not None:  # given again: recorded and counted when it was first given
                return decision
            if task_id is not None and self.max_lost_deliveries and decision.authorized:
                tx.count_unfinished(task_id)
            if decision.verdict in REFUSALS:
                tx.count_refusal(decision.verdict.value)
            if decision.authorized:
                _count_start(tx, decision, record)
            if record is not None and self.ledger_max and decision.authorized:
                tx.record_start(self._ledger_row(queue, state, ticket, task_id, record, decision, cost))
            return decision

    def start_all(
        self,
        queues: Sequence[str],
        tickets: Sequence[int],
        epochs: Sequence[str],
        *,
        task_id: str | None,
        interval_us: Sequence[int],
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Sequence[Limits] | None = None,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> list[Decision]:
        each = list(limits) if limits is not None else [NO_LIMITS] * len(queues)
        member = self.lease_member(task_id, record, lease)
        with self._following(queues) as txs:
            states = [
                self._created(tx, q, i, new_epoch, lim)
                for tx, q, i, lim in zip(txs, queues, interval_us, each, strict=True)
            ]
            finished = task_id is not None and txs[0].is_finished(task_id)
            lost = self._lost(txs[0], task_id)
            leases = [tx.leases() for tx in txs]
            now = txs[0].now_us
            token = self._run_token(task_id, member, token)
            own = rules.own_start(leases[0], task_id, token, now)
            decisions = rules.start_all(
                states, list(tickets), list(epochs), now, finished=finished, cost=cost, lost=lost,
                windows=[self._window(tx, state) for tx, state in zip(txs, states, strict=True)], leases=leases,
                lease=self._lease_taken(states, task_id, member, now),
                running_us=rules.running_copy(leases[0], task_id, now), token=token, own=own,
                begin_wait_us=begin_wait_us, run=self._is_run(task_id, member),
            )  # fmt: skip
            if own is not None:  # given again: recorded and counted when it was first given
                return decisions
            if task_id is not None and self.max_lost_deliveries and decisions[0].authorized:
                txs[0].count_unfinished(task_id)
            for tx, d in zip(txs, decisions, strict=True):
                if d.verdict in REFUSALS:
                    tx.count_refusal(d.verdict.value)
                if d.authorized:  # in every queue, or in none
                    _count_start(tx, d, record)
            if record is not None and self.ledger_max and decisions[0].authorized:
                for tx, queue, state, d in zip(txs, queues, states, decisions, strict=True):
                    tx.record_start(self._ledger_row(queue, state, d.ticket, task_id, record, d, cost))
            return decisions

    def _ledger_row(
        self, queue: str, state: QueueState, ticket: int, task_id: str | None, record: StartRecord, d: Decision,
        cost: int,
    ) -> LedgerRow:  # fmt: skip
        """The ledger row of an authorized start: who started, the slot it met, and the
        limits in force (with the lease it took under a concurrency cap, if any: a run's lease
        without a cap is not the audit's business)."""
        return LedgerRow(
            queue, state.epoch, ticket, task_id or record.task_id, record.task_name, d.slot_us, d.now_us,
            state.interval_us, deferrals=record.deferrals, host=record.host, pid=record.pid, cost=cost,
            burst=state.burst, quota=state.quota, window_us=state.window_us, concurrency=state.concurrency,
            lease_us=self.lease_timeout_us if d.lease and state.concurrency else 0, fair_key=record.fair_key,
            fair_tag=record.fair_tag, fair_weight=record.fair_weight,
            lease=d.lease if d.lease and state.concurrency else None,
        )  # fmt: skip

    def _lost(self, tx: Transaction, task_id: str | None) -> bool:
        if task_id is None or not self.max_lost_deliveries:
            return False
        return rules.too_many_lost(tx.unfinished_starts(task_id), self.max_lost_deliveries)

    def restamp(self, queue: str, epoch: str, started_us: int) -> int | None:
        with self.transaction(queue) as tx:
            if tx.state is None:
                return None
            return rules.restamp(tx.state, epoch, started_us, tx.now_us, self._window(tx, tx.state))

    def began(self, queue: str, started_us: int, task_id: str = "", *, soon: bool = False) -> int | None:
        with self.transaction(queue) as tx:
            if tx.state is None:
                return None
            at = rules.began(tx.state, started_us, tx.now_us, self._window(tx, tx.state))
            if self.ledger_max and (at is not None or soon):
                tx.record_began(task_id, started_us, tx.now_us if at is None else at)
            return at

    def finish(
        self, queue: str, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = ""
    ) -> None:
        lease = lease or task_id  # a run's lease is named by its task id (lease_member)
        with self.transaction(queue) as tx:
            returned = bool(lease) and rules.give_back(tx.state, tx.leases(), lease, tx.now_us)
            if returned and tx.state is not None and tx.state.concurrency:
                self._woke(queue, tx.state.current + 1, tx.now_us)
            tx.clear_unfinished(task_id)
            if remember:
                tx.add_finished(task_id)
            if self.ledger_max:  # the ledger names a lease taken under a cap only (_ledger_row)
                capped = tx.state is not None and tx.state.concurrency > 0
                tx.record_finish(task_id, outcome, lease if capped else "", returned and capped)

    def renew_leases(self, queue: str, leases: Sequence[str]) -> int:
        if not leases:
            return 0
        with self.transaction(queue) as tx:
            return rules.renew_leases(tx.state, tx.leases(), leases, tx.now_us, self.lease_timeout_us)

    def _existing(self, tx: Transaction, queue: str) -> QueueState:
        if tx.state is None:
            raise QueueNotFoundError(f"queue {queue!r} has no state in this store")
        return tx.state

    def pause(self, queue: str, epoch: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            if tx.state is None:  # before any worker: created paused, no interval known yet
                tx.window().trim(1 << 62)
                tx.state = rules.paused_new_state(tx.now_us, epoch or secrets.token_hex(8))
            rules.pause(tx.state)
            return copy_state(tx.state)

    def resume(self, queue: str, grace_us: int = 0) -> QueueState:
        with self._following_one(queue) as tx:
            state = self._existing(tx, queue)
            if state.paused and rules.no_limit_known(state):
                raise no_interval_yet(queue)
            rules.resume(state, tx.now_us, grace_us)
            return copy_state(state)

    def set_interval(self, queue: str, interval_us: int | None, origin: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            state = self._existing(tx, queue)
            tx.save_sources(rules.override(state, tx.sources(), tx.now_us, interval_us, origin))
            return copy_state(state)

    def set_limits(self, queue: str, override: LimitsOverride | None, origin: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            state = self._existing(tx, queue)
            tx.save_sources(rules.override_limits(state, tx.sources(), tx.now_us, override, origin))
            return copy_state(state)

    def declare(
        self,
        queue: str,
        interval_us: int,
        epoch: str,
        *,
        node: str = "",
        ttl_us: int = 0,
        origin: str = "",
        announce: bool = True,
        limits: Limits = NO_LIMITS,
    ) -> Declared:
        with self.transaction(queue) as tx:
            created = tx.state is None
            state = self._created(tx, queue, interval_us, epoch, limits)
            sources, done = rules.declare(
                state, tx.sources(), tx.now_us, interval_us, node=node, ttl_us=ttl_us, origin=origin,
                announce=announce, limits=limits,
            )  # fmt: skip
            tx.save_sources(sources)
            if created:
                return replace(done, created=True, old_interval_us=0, old_limits=NO_LIMITS)
            return done

    def backoff(self, queue: str, hold_us: int, keep_first: bool = False) -> QueueState:
        with self._following_one(queue) as tx:
            rules.backoff(self._existing(tx, queue), tx.now_us, hold_us, keep_first)
            return copy_state(self._existing(tx, queue))

    def reset(
        self, queue: str, interval_us: int | None, epoch: str, origin: str = "", *, limits: Limits = NO_LIMITS
    ) -> QueueState:
        with self._following_one(queue, replace_corrupt=True) as tx:
            if tx.state is None:
                if interval_us is None:
                    raise QueueNotFoundError(f"queue {queue!r} has no state in this store")
                tx.state = _new_state(tx, interval_us, epoch, limits)
            tx.state = rules.reset(tx.state, tx.now_us, epoch, interval_us)
            if interval_us:
                tx.save_sources(rules.pin(tx.sources(), tx.now_us, interval_us, origin))
            tx.state.ticket = tx.renumber_parked()  # parked tasks keep their order in the new life
            return copy_state(tx.state)

    def status(self, queue: str) -> QueueStatus | None:
        with self.transaction(queue) as tx:
            if tx.state is None:
                return None
            # Read only, as on Redis: the interval and limits the next start will use (a node
            # declaration expired since counts no more), not written: a read changes nothing.
            state, sources, used, slots = copy_state(tx.state), tx.sources(), 0, (0, 0)
            sources = rules.follow_expiry(state, sources, tx.now_us) or sources
            if state.quota:  # read only: what a status read forgot would not move the anchor
                used = rules.window_used(tx.window(), tx.now_us - state.window_us)
                slots = rules.status_window(state, tx.window(), tx.now_us)
            in_flight = tx.leases().live(tx.now_us) if state.concurrency else 0
            fair = tx.fair_backlog(0)
            return QueueStatus(
                queue, state, tx.now_us, tx.finished_count(), tx.parked_count(), sources, *tx.refusals(),
                window_used=used, counts=rules.counts_from_fields(tx.start_counts()), in_flight=in_flight,
                window_next_us=slots[0], window_last_us=slots[1], fair_keys=fair.keys_waiting,
                fair_tasks=fair.tasks_waiting,
            )  # fmt: skip

    def park(self, queue: str, epoch: str, tasks: Sequence[ParkedTask]) -> bool:
        with self.transaction(queue) as tx:
            if tx.state is None or tx.state.epoch != epoch:
                return False
            tx.park(tasks)
            return True

    def release(
        self, queue: str, horizon_us: int, limit: int = RELEASE_LIMIT, lease_us: int = RELEASE_LEASE_US
    ) -> Release:
        with self._following_one(queue) as tx:
            if tx.state is None:
                return Release("", tx.now_us, [])
            state, now = tx.state, tx.now_us
            window = self._window(tx, state)
            if not state.paused:  # see rules.release_cutoff
                units = rules.window_units(state, window, now)
                held = 0 if units is None else units.slot(state.current + 1, 1)
                rules.shift_after_outage(state, now, horizon_us, held)
            promoted = rules.fair_promote(state, tx.fair_lines(), now, window)
            if promoted:  # each parked with its fair share in its message, for the ledger
                messages = tx.fair_messages()
                tx.park([
                    ParkedTask(ticket, t.task_id, with_fair_share(messages.take(t.task_id), t.key, t.tag, t.weight))
                    for ticket, t in promoted
                ])  # fmt: skip
            units = rules.window_units(state, window, now)  # read again: the line may have shifted
            tasks = tx.leasable(rules.release_cutoff(state, now, horizon_us, units), now, limit)
            tx.lease([t.task_id for t in tasks], now + lease_us)
            return Release(state.epoch, now, [(t, rules.estimate_of(state, t.ticket, now, units)) for t in tasks])

    def unpark(self, queue: str, task_ids: Sequence[str]) -> None:
        with self.transaction(queue) as tx:
            tx.unpark(task_ids)

    def fair_park(
        self, queue: str, key: str, weight: int, tasks: Sequence[FairTask], interval_us: int, epoch: str,
        *, limits: Limits = NO_LIMITS,
    ) -> list[str]:  # fmt: skip
        rules.fair_check(key, weight, [t.cost for t in tasks])  # before anything is written
        still_parked: list[str] = []
        with self._following_one(queue) as tx:
            self._created(tx, queue, interval_us, epoch, limits)
            lines, messages = tx.fair_lines(), tx.fair_messages()
            for task in tasks:
                if tx.is_parked(task.task_id):  # its last run's releaser may be about to unpark it
                    still_parked.append(task.task_id)
                elif messages.get(task.task_id) is None:  # a publish sent again waits once
                    rules.fair_push(lines, key, task.task_id, task.cost, weight)
                    messages.keep(task.task_id, task.message)
        return still_parked

    def fair_backlog(self, queue: str, top: int = 10) -> FairBacklog:
        check_top(top)
        with self.transaction(queue, replace_corrupt=True) as tx:  # the state is not read (nor written)
            return tx.fair_backlog(top)

    def parked_tasks(self, queue: str) -> list[ParkedTask]:
        with self.transaction(queue) as tx:  # everything, leased (listed first by leasable) or not
            return sorted(tx.leasable(1 << 62, 1 << 62, 1 << 62), key=lambda t: t.ticket)

    def delete(self, queue: str) -> bool:
        with self.transaction(queue) as tx:
            existed = tx.delete()
            tx.state = None
            return existed


def _count_start(tx: Transaction, decision: Decision, record: StartRecord | None) -> None:
    """Count an authorized start in its queue's counters (rules.start_counts), in the
    start's own transaction."""
    last = tx.start_counts().get(rules.LAST_COUNTED)
    deferrals = record.deferrals if record is not None else 0
    added = rules.start_counts(last, decision.now_us, decision.slot_us, decision.interval_us, deferrals)
    tx.count_start(added, decision.now_us)


def _new_state(tx: Transaction, interval_us: int, epoch: str, limits: Limits) -> QueueState:
    """A state created from nothing, with an empty window: a lost state forgets its window's
    starts as it forgets its last start (docs/design.md, "The guarantees": the window across a lost state)."""
    tx.window().trim(1 << 62)
    return rules.new_state(tx.now_us, interval_us, epoch, limits)
