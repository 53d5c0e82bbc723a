"""Model-based test: random sequences of claim / start / finish (or a retry's end) / lease
renewal / pause / resume / set_interval / reset / state loss / clock moves, applied to the
memory, SQLite and Redis stores side by side and to a small reference model written here from
docs/design.md, on a queue with a burst, a window quota and a concurrency cap drawn for each
example (none, most often). Every answer and every state must agree; without a burst no two
authorized starts may be closer than the interval in force, no window of the quota's length
holds more than its quota, and no more leases than the cap are ever live.

A second machine (SourcesAgree) draws declarations of worker nodes and scripts with their
limits, overrides of the interval and of each kind of limit, and clock moves past the
declarations' TTL: every store must give a reference's effective interval and limits."""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from siq_celery.backends import Backend, backend_from_url
from siq_celery.rules import BEGIN_WAIT_US
from siq_celery.testing import PinnedClock
from siq_celery.types import Limits

EXAMPLES = int(os.environ.get("SIQ_HYPOTHESIS_EXAMPLES", "500"))
INTERVALS = [10_000, 25_000, 100_000]
TASKS = ["a", "b", "c", "d"]
MAX_LOST = 2  # a task id whose last 2 authorized starts never finished is refused
LEASE_US = 300_000  # a lease not renewed expires this long after its start (or last renewal)
LEASE_POLL_US = 10_000  # a start held by a full cap asks again after this, or at the earliest expiry
LEASE_GRACE_US = 20_000  # a ticket keeps its claim on a free lease this long after its slot
_run = itertools.count()


@dataclass
class Reference:
    """The rules of docs/design.md, "The model", written independently of siq_celery.rules."""

    clock: PinnedClock
    q: dict[str, object] | None = None
    finished: set[str] = field(default_factory=set)
    unfinished: dict[str, int] = field(default_factory=dict)  # authorized starts since the last finish
    burst: int = 0
    quota: int = 0  # cost units in any window of `window` (0: none)
    window: int = 0
    win: list[list[int]] = field(default_factory=list)  # the window's starts: [time, units], by time
    conc: int = 0  # bodies running at once (0: no cap)
    leases: dict[str, int] = field(default_factory=dict)  # member -> expiry

    def shift(self, at: int) -> None:
        """A lease came back at ``at`` while the cap was full: a head due before then is due then."""
        q = self.q
        if q is not None and q["ticket"] > q["cur"] and q["anchor"] + q["I"] < at:  # type: ignore[operator]
            q["anchor"] = at - q["I"]  # type: ignore[operator]

    def read_leases(self) -> int:
        """The live leases; forgetting expired ones that brought a full cap below it is a release."""
        now, before = self.clock.now_us, len(self.leases)
        gone = sorted(e for e in self.leases.values() if e <= now)
        self.leases = {m: e for m, e in self.leases.items() if e > now}
        n = self.conc if self.q is not None else 0
        if n and gone and before >= n > before - len(gone):
            self.shift(gone[before - n])
        return len(self.leases)

    def give_back(self, member: str) -> None:
        count = self.read_leases()
        kept = self.leases.pop(member, None) is not None
        if kept and self.q is not None and self.conc and count >= self.conc:
            self.shift(self.clock.now_us)

    def renew(self, members: list[str]) -> int:
        self.read_leases()
        kept = [m for m in set(members) if m in self.leases]
        for m in kept:
            self.leases[m] = self.clock.now_us + LEASE_US
        return len(kept)

    def _new(self, interval: int, epoch: str) -> dict[str, object]:
        now = self.clock.now_us  # a burst's credit starts spent: still one interval
        return {"epoch": epoch, "I": interval, "ticket": 0, "cur": 0, "anchor": now,
                "last": now + self.burst * interval, "paused": False, "began": 0, "pend": 0,
                "pend_due": 0}  # fmt: skip

    def state(self) -> tuple[object, ...] | None:
        q = self.q
        if q is None:
            return None
        return (q["epoch"], q["I"], q["ticket"], q["cur"], q["anchor"], q["last"], q["paused"], self.burst,
                self.quota, self.window, self.conc)  # fmt: skip

    def cap(self) -> int:  # GCRA: the theoretical arrival time less the burst
        q = self.q
        return q["last"] + q["I"] - self.burst * q["I"]  # type: ignore[index, operator, no-any-return]

    def read_window(self) -> list[int]:
        """The window at now, unit by unit (oldest first); a unit whose leaving let the head
        in makes the line due from then."""
        q, now = self.q, self.clock.now_us
        units = [t for t, c in self.win for _ in range(c)]
        k = len(units) + 1 - self.quota
        if k >= 1 and units[k - 1] <= now - self.window:
            q["anchor"] = max(q["anchor"], units[k - 1] + self.window - q["I"])  # type: ignore[index, call-overload, operator]
        keep = now - self.window  # the last start stays while its body may still report
        if q["pend"]:
            keep = min(keep, q["began"] - 1)  # type: ignore[call-overload, operator]
        self.win = [e for e in self.win if e[0] > keep]
        return [t for t, c in self.win for _ in range(c)]

    def window_slot(self, units: list[int], memo: dict[int, int], ticket: int, cost: int) -> int:
        q, m, n = self.q, len(units), self.quota

        def at(u: int) -> int | None:  # when unit u of the window, then of the line, starts
            if u < 1:
                return None
            if u <= m:
                return units[u - 1]
            if u not in memo:
                spacing = max(q["anchor"] + (u - m) * q["I"], self.cap())  # type: ignore[index, operator]
                before = at(u - n)
                memo[u] = spacing if before is None else max(spacing, before + self.window)
            return memo[u]

        c = min(cost, n)
        ahead = ticket - q["cur"] - 1 if ticket > q["cur"] else 0  # type: ignore[index, operator]
        hard, line = at(m + c - n), at(m + ahead + c - n)
        return max(0 if hard is None else hard + self.window, 0 if line is None else line + self.window)

    def claim(self, n: int, interval: int, epoch: str) -> tuple[int, str, int, int, tuple[int, ...]]:
        now = self.clock.now_us
        q = self.q = self.q or self._new(interval, epoch)
        units = self.read_window() if self.quota else None
        first = q["ticket"] + 1  # type: ignore[operator]
        due = q["anchor"] + (first - q["cur"]) * q["I"]  # type: ignore[operator]
        free = max(now, self.cap())
        rebase = max(now, q["last"] + q["I"]) - self.burst * q["I"]  # type: ignore[operator]
        if due < rebase:  # an overdue line (or a head held by the cap): due at the first free slot
            q["anchor"] = q["anchor"] + rebase - due  # type: ignore[operator]
            due = rebase
        q["ticket"] = q["ticket"] + n  # type: ignore[operator]
        memo: dict[int, int] = {}
        slots = [] if units is None else [self.window_slot(units, memo, first + i, 1) for i in range(n)]
        return first, str(q["epoch"]), due, free, tuple(slots) if any(slots) else ()

    def start(
        self, number: int, epoch: str, task: str | None, interval: int, new_epoch: str, cost: int, member: str,
        begin_wait: int = 0,
    ) -> tuple[str, int, int, bool]:  # fmt: skip
        """A start whose body reports is authorized up to the lead (a quarter interval, 5 ms
        at most) before its slot, as if it had asked at the slot; its answer's wait is how
        far ahead."""
        now = self.clock.now_us
        answer = self._start_at(number, epoch, task, interval, new_epoch, cost, member, begin_wait, now)
        verdict, wait, slot, full = answer
        lead = min(self.q["I"] // 4, 5_000)  # type: ignore[index, operator]
        if not begin_wait or verdict != "wait" or full or not now < slot or wait != slot - now or wait > lead:
            return answer
        clock, self.clock = self.clock, SimpleNamespace(now_us=slot)  # type: ignore[assignment]
        try:
            ahead = self._start_at(number, epoch, task, interval, new_epoch, cost, member, begin_wait, now)
        finally:
            self.clock = clock
        return ("authorized", slot - now, ahead[2], False) if ahead[0] == "authorized" else answer

    def _start_at(
        self, number: int, epoch: str, task: str | None, interval: int, new_epoch: str, cost: int, member: str,
        begin_wait: int, asked: int,
    ) -> tuple[str, int, int, bool]:  # fmt: skip
        """The start asked at ``asked``, decided on the clock's time (``asked``, or the slot
        it is authorized for ahead); its run's lease expires from when it was asked."""
        now = self.clock.now_us
        q = self.q = self.q or self._new(interval, new_epoch)
        if task is not None and task in self.finished:
            return "duplicate", 0, 0, False
        if task is not None and self.leases.get(task, 0) > now:  # a copy of it runs: its lease is live
            return "running", self.leases[task] - now, 0, False
        if task is not None and self.unfinished.get(task, 0) >= MAX_LOST:
            return "lost", 0, 0, False
        if epoch != q["epoch"] or not 1 <= number <= q["ticket"] - cost + 1:  # type: ignore[operator]
            return "reclaim", 0, 0, False
        I, cur = q["I"], q["cur"]
        if q["paused"]:
            return "paused", max(number - cur - 1, 0) * I, 0, False  # type: ignore[operator]
        live = self.read_leases() if self.conc else 0  # first: a release may move the line
        full = bool(self.conc) and live >= self.conc
        units = self.read_window() if self.quota else None
        memo: dict[int, int] = {}
        held = 0 if units is None or number <= cur else self.window_slot(units, memo, cur + 1, 1)  # type: ignore[operator]
        held = max(held, now if full else 0)  # a head the cap holds is not late either
        settle = max(10 * I, 1_000_000)  # type: ignore[call-overload]
        overdue = max(q["anchor"] + I, held) < now - settle  # type: ignore[operator]  # a head the window holds is not late
        outage = q["anchor"] <= q["last"] + I and overdue  # type: ignore[operator]
        if number > cur and outage:  # type: ignore[operator]
            q["anchor"] = now + settle - I  # type: ignore[operator]  # a long-overdue head: the backlog shifts once
        due = q["anchor"] + (number - cur) * I if number > cur else 0  # type: ignore[operator]
        slot = max(due, self.cap(), 0 if units is None else self.window_slot(units, memo, number, cost))
        if now < slot:
            return "wait", slot - now, slot, False
        poll = max(min(LEASE_POLL_US, min(self.leases.values(), default=now + LEASE_POLL_US) - now), 1)
        if full:  # a short poll, or the earliest expiry if sooner
            return "wait", poll, slot, True
        # Each ticket ahead keeps a claim on a lease until the grace after its slot: this one
        # takes a lease only if one is left over for every claim still held.
        claims = (number - cur - 1) - (self.conc - live - 1)  # type: ignore[operator]
        if self.conc and number > cur + 1 and claims > 0:  # type: ignore[operator]
            turn = max(q["anchor"] + claims * I, self.cap()) + LEASE_GRACE_US  # type: ignore[operator]
            if now < turn:
                return "wait", min(poll, turn - now), slot, True
        if q["pend"] > now:  # type: ignore[operator]  # the last start's body has not reported: ask again soon
            return "wait", max(min(max(I // 4, 500), 5_000, q["pend"] - now), 1), slot, False  # type: ignore[operator]
        # a start whose body will report: later ones wait for it (begin_wait at most)
        q["pend"], q["pend_due"] = (now + begin_wait, q["last"] + I) if begin_wait else (0, 0)  # type: ignore[operator]
        q["cur"] = max(cur, number + cost - 1)  # type: ignore[call-overload]
        q["last"] = max(q["last"] + I, now) + (cost - 1) * I  # type: ignore[operator]  # GCRA: T = max(T, now) + c I
        q["began"] = now  # the start itself, what a re-stamp moves
        q["anchor"] = max(q["anchor"] + (q["cur"] - cur) * I, q["last"] - self.burst * I)  # type: ignore[operator]
        if self.quota:
            self.win.append([now, min(cost, self.quota)])
            self.win.sort(key=lambda e: e[0])
        if task is not None:
            self.unfinished[task] = self.unfinished.get(task, 0) + 1
        if task is not None or self.conc:  # one lease, whatever the cost: the run's, named by its task id
            if not self.conc:
                self.leases = {m: e for m, e in self.leases.items() if e > now}
            self.leases[task or member] = asked + LEASE_US
        return "authorized", 0, slot, False

    def began(self, started: int) -> int | None:
        """The body of the start authorized at ``started`` reports now: if it is the last,
        pending start, it is placed as if authorized now (its last slot from the slot before)."""
        q, now = self.q, self.clock.now_us
        again = q is not None and q["pend"] < 0 and q["pend"] == -started  # type: ignore[operator]  # reported: sent again
        if q is None:
            return None
        if not again and (q["pend"] <= 0 or q["began"] != started):  # type: ignore[operator]
            # overtaken: under a burst with room now (no quota, not paused), one more start charged now
            if not self.burst or self.quota or q["paused"] or self.cap() > now:
                return None
            q["last"] = max(q["last"] + q["I"], now)  # type: ignore[call-overload, operator]
            q["anchor"] = max(q["anchor"], q["last"] - self.burst * q["I"])  # type: ignore[call-overload, operator]
            return now
        I = q["I"]
        prev = q["began"]
        at, base = max(now, prev), q["pend_due"]  # type: ignore[call-overload]
        q["last"] += max(base, at) - max(base, prev)  # type: ignore[call-overload, operator]
        q["anchor"] = max(q["anchor"], q["last"] - self.burst * I)  # type: ignore[call-overload, operator]
        moved = [e for e in self.win if e[0] == prev]
        if self.quota and moved and at != prev:
            moved[-1][0] = at
            self.win.sort(key=lambda e: e[0])
        q["began"], q["pend"] = at, -started
        return at

    def backoff(self, hold: int, keep_first: bool) -> None:
        q = self.q
        until = self.clock.now_us + hold - q["I"]  # type: ignore[index, operator]
        q["last"] = max(q["last"], until + self.burst * q["I"])  # type: ignore[index, call-overload, operator]
        q["anchor"] = max(q["anchor"], until + (q["I"] if keep_first else 0))  # type: ignore[index, call-overload, operator]


class StoresAgree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        run = next(_run)
        self.clock = PinnedClock()
        self.ref = Reference(self.clock)
        self.dir = tempfile.TemporaryDirectory()
        prefix = f"hyp{run}"
        urls = [f"memory://hyp-{os.getpid()}-{run}", f"sqlite:///{self.dir.name}/siq.db", REDIS_URL[0]]
        # No ledger (no start here carries a record; a finish would still write one on Redis).
        self.stores: list[Backend] = [
            backend_from_url(
                u,
                clock=self.clock,
                key_prefix=prefix,
                max_lost_deliveries=MAX_LOST,
                ledger_max=0,
                lease_timeout_us=LEASE_US,
            )
            for u in urls
        ]
        self.tickets: list[tuple[int, str]] = []
        self.epochs = (f"e{i}" for i in itertools.count())
        self.interval = INTERVALS[0]
        self.limits = Limits()
        self.starts: list[tuple[int, int]] = []  # (time, least time to the next start)
        self.window_starts: list[tuple[int, int]] = []  # (time, units) while the window is kept
        # Back-offs in force, (index of the first start after it, until): no start before
        # until. A shorter interval set later shortens a back-off by the difference, and a
        # lost state forgets it.
        self.backoffs: list[tuple[int, int]] = []
        self.members = (f"L{i}" for i in itertools.count())
        self.held: list[str] = []  # lease members taken (given back or expired ones too)

    def teardown(self) -> None:
        for s in self.stores:
            s.delete("q")
            s.close()
        self.dir.cleanup()

    def _all(self, op: str, *args: object, **kwargs: object) -> object:
        answers = [getattr(s, op)("q", *args, **kwargs) for s in self.stores]
        assert all(a == answers[0] for a in answers), (op, answers)
        return answers[0]

    @initialize(
        burst=st.sampled_from([0, 0, 1, 3]), quota=st.sampled_from([None, None, (2, 150_000), (4, 600_000)]),
        conc=st.sampled_from([0, 0, 1, 2]),
    )  # fmt: skip
    def limits_of_the_queue(self, burst: int, quota: tuple[int, int] | None, conc: int) -> None:
        self.limits = Limits(burst, *(quota or (0, 0)), conc)
        self.ref.burst, self.ref.quota, self.ref.window = self.limits.burst, self.limits.quota, self.limits.window_us
        self.ref.conc = conc

    @rule(us=st.integers(0, 250_000))
    def advance(self, us: int) -> None:
        self.clock.advance(us=us)

    @rule(n=st.integers(1, 3))
    def claim(self, n: int) -> None:
        epoch = next(self.epochs)
        results = [s.claim("q", n, self.interval, epoch, limits=self.limits) for s in self.stores]
        expected = self.ref.claim(n, self.interval, epoch)
        for i, r in enumerate(results):
            assert (r.first, r.epoch, r.base_us, r.floor_us, r.window_us) == expected, (i, self.ref.win, self.ref.q)
        self.tickets += [(expected[0] + i, expected[1]) for i in range(n)]

    @precondition(lambda self: self.tickets)
    @rule(
        data=st.data(), task=st.sampled_from([None, *TASKS]), cost=st.sampled_from([1, 1, 2, 3]),
        begin_wait=st.sampled_from([0, BEGIN_WAIT_US]),
    )  # fmt: skip
    def start(self, data: st.DataObject, task: str | None, cost: int, begin_wait: int) -> None:
        self._start(*data.draw(st.sampled_from(self.tickets)), task, cost, begin_wait)

    @precondition(lambda self: self.ref.q is not None and self.ref.q["ticket"] > self.ref.q["cur"])  # type: ignore[operator]
    @rule(us=st.integers(0, 150_000), begin_wait=st.sampled_from([0, BEGIN_WAIT_US]))
    def start_the_head(self, us: int, begin_wait: int) -> None:
        """The head of the line asks a little later (most drawn starts are of stale or passed tickets)."""
        self.clock.advance(us=us)
        q = self.ref.q
        self._start(q["cur"] + 1, q["epoch"], None, 1, begin_wait)  # type: ignore[index, operator, arg-type]

    @precondition(lambda self: self.ref.q is not None and self.ref.q["ticket"] > self.ref.q["cur"])  # type: ignore[operator]
    @rule(late=st.sampled_from([0, 300, 4_000, 30_000, 600_000]), task=st.sampled_from([None, *TASKS]))
    def a_body_reports(self, late: int, task: str | None) -> None:
        """The head of the line waits for its slot, starts with a body that will report, and
        the body reports ``late`` after its authorization (past the start's wait: 600 ms)."""
        for _ in range(4):
            q = self.ref.q
            if q is None or q["ticket"] <= q["cur"]:  # type: ignore[operator]
                return
            verdict, wait = self._start(q["cur"] + 1, q["epoch"], task, 1, BEGIN_WAIT_US)  # type: ignore[index, operator, arg-type]
            if verdict != "wait":
                break
            self.clock.advance(us=wait)
        self.began(False, late, 0)

    def _start(self, number: int, epoch: str, task: str | None, cost: int, begin_wait: int = 0) -> tuple[str, int]:
        new_epoch, member = next(self.epochs), next(self.members)
        decisions = [
            s.start(
                "q",
                number,
                epoch,
                task_id=task,
                interval_us=self.interval,
                new_epoch=new_epoch,
                cost=cost,
                limits=self.limits,
                lease=member,
                begin_wait_us=begin_wait,
            )
            for s in self.stores
        ]
        verdict, wait, slot, full = self.ref.start(
            number, epoch, task, self.interval, new_epoch, cost, member, begin_wait
        )
        taken = (task or member) if verdict == "authorized" and (task or self.limits.concurrency) else ""
        for d in decisions:
            assert (d.verdict.value, d.wait_us, d.slot_us, d.full, d.lease) == (verdict, wait, slot, full, taken)
        if taken:
            self.held.append(taken)
        if verdict == "authorized":  # the next start may come no sooner than cost intervals
            at = self.clock.now_us + wait  # authorized ahead of its slot: the start is at the slot
            self.starts.append((at, cost * self.ref.q["I"]))  # type: ignore[index, operator]
            if self.limits.quota:
                self.window_starts.append((at, min(cost, self.limits.quota)))
        return verdict, wait

    @precondition(lambda self: self.ref.q is not None)
    @rule(stale=st.booleans(), same_epoch=st.booleans())
    def restamp(self, stale: bool, same_epoch: bool) -> None:
        q = self.ref.q
        epoch = q["epoch"] if same_epoch else "other"  # type: ignore[index]
        started = q["last"] - (1 if stale else 0)  # type: ignore[index, operator]  # the last slot (rules.restamp)
        got = self._all("restamp", epoch, started)
        now, began = self.clock.now_us, q["began"]
        expected = None
        recorded = 0 < began <= q["last"]  # type: ignore[operator]  # a start to move (none before the first)
        if not self.limits.burst and epoch == q["epoch"] and started == q["last"] and now >= began and recorded:  # type: ignore[index, operator]
            q["last"] = q["last"] + now - began  # type: ignore[index, operator]  # the start and its last slot alike
            q["began"] = expected = now  # type: ignore[index]
            q["anchor"] = max(q["anchor"], q["last"])  # type: ignore[index, call-overload]
            if self.starts:
                self.starts[-1] = (now, self.starts[-1][1])
            moved = [e for e in self.ref.win if e[0] == began]
            if self.limits.quota and moved:  # the start moves in the window too
                moved[-1][0] = now
                self.ref.win.sort(key=lambda e: e[0])
                self.window_starts[-1] = (now, self.window_starts[-1][1])
        assert got == expected

    @precondition(lambda self: self.ref.q is not None)
    @rule(stale=st.booleans(), us=st.sampled_from([0, 300, 4_000, 30_000]), again=st.sampled_from([0, 0, 200, 5_000]))
    def began(self, stale: bool, us: int, again: int) -> None:
        """A body reports, ``us`` after now, that it began: the last start's (or, stale, another's);
        ``again``: its process stood still after the report, and reports again that much later."""
        self.clock.advance(us=us)
        q = self.ref.q
        authorized = -q["pend"] if q["pend"] < 0 else q["began"]  # type: ignore[index, operator]
        started = authorized - (1 if stale else 0)  # type: ignore[operator]
        self._report(started)
        if again:
            self.clock.advance(us=again)
            self._report(started)

    def _report(self, started: int) -> None:
        q = self.ref.q
        before = q["began"] if q is not None else None
        again = q is not None and q["pend"] < 0 and q["pend"] == -started  # type: ignore[operator]
        overtaken = q is not None and not again and (q["pend"] <= 0 or q["began"] != started)  # type: ignore[operator]
        got = self._all("began", started)
        expected = self.ref.began(started)
        assert got == expected
        if expected is not None and overtaken:  # charged as one more start (a burst with room)
            self.starts.append((expected, self.ref.q["I"]))  # type: ignore[index]
        elif expected is not None and expected != before:  # the start moved: so do its places
            if self.starts:
                self.starts[-1] = (expected, self.starts[-1][1])
            if self.limits.quota and self.window_starts and self.window_starts[-1][0] == before:
                self.window_starts[-1] = (expected, self.window_starts[-1][1])

    @rule(data=st.data(), task=st.sampled_from(TASKS), remember=st.booleans())
    def finish(self, data: st.DataObject, task: str, remember: bool) -> None:
        lease = data.draw(st.sampled_from(["", *self.held[-4:]]))  # the run's lease, if it took one
        self._all("finish", task, remember=remember, lease=lease)  # not remembered: a run that ended in a retry
        self.ref.give_back(lease or task)  # none named: the run's, named by its task id
        if remember:
            self.ref.finished.add(task)
        self.ref.unfinished.pop(task, None)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        members = data.draw(st.lists(st.sampled_from(self.held[-4:]), min_size=1, max_size=3))
        assert self._all("renew_leases", members) == self.ref.renew(members)

    @precondition(lambda self: self.ref.q is not None)
    @rule()
    def pause(self) -> None:
        self._all("pause")
        self.ref.q["paused"] = True  # type: ignore[index]

    @precondition(lambda self: self.ref.q is not None)
    @rule(grace=st.sampled_from([0, 5_000, 1_000_000]))
    def resume(self, grace: int) -> None:
        self._all("resume", grace)
        q = self.ref.q
        if q["paused"]:  # type: ignore[index]
            q["paused"] = False  # type: ignore[index]
            q["anchor"] = max(q["anchor"], self.clock.now_us + grace - q["I"])  # type: ignore[index, operator]

    @precondition(lambda self: self.ref.q is not None)
    @rule(hold=st.sampled_from([0, 50_000, 1_000_000]), keep_first=st.booleans())
    def backoff(self, hold: int, keep_first: bool) -> None:
        self._all("backoff", hold, keep_first=keep_first)
        self.ref.backoff(hold, keep_first)
        self.backoffs.append((len(self.starts), self.clock.now_us + hold))

    @precondition(lambda self: self.ref.q is not None)
    @rule(interval=st.sampled_from(INTERVALS))
    def set_interval(self, interval: int) -> None:
        self._all("set_interval", interval)
        self._interval_changed(self.ref.q["I"], interval)  # type: ignore[index, arg-type]
        self.ref.q["I"] = interval  # type: ignore[index]
        self.backoffs.clear()

    def _interval_changed(self, old: int, new: int) -> None:
        """A new interval applies from the next start: it may come the new interval after the
        last slot the last start used (a cost's later slots were counted at the old one)."""
        if self.starts:
            at, least = self.starts[-1]
            self.starts[-1] = (at, least - old + new)

    @precondition(lambda self: self.ref.q is not None)
    @rule(interval=st.sampled_from([None, *INTERVALS]))
    def reset(self, interval: int | None) -> None:
        epoch = next(self.epochs)
        self._all("reset", interval, epoch)
        old = self.ref.q
        self._interval_changed(old["I"], interval or old["I"])  # type: ignore[index, arg-type]
        q = self.ref._new(interval or old["I"], epoch)  # type: ignore[index, arg-type]
        q["last"], q["anchor"], q["began"] = old["last"], self.clock.now_us - q["I"], old["began"]  # type: ignore[index, operator]
        q["pend"], q["pend_due"] = old["pend"], old["pend_due"]  # type: ignore[index]  # its body still reports
        self.ref.q = q
        if interval:  # as set_interval: another interval moves the back-off's end (burst x interval too)
            self.backoffs.clear()

    @rule()
    def lose_state(self) -> None:
        self._all("delete")
        self.ref.q = None
        self.ref.finished.clear()
        self.ref.unfinished.clear()
        self.ref.win.clear()  # a lost state forgets its window (docs/design.md)
        self.ref.leases.clear()  # and its leases
        self.window_starts.clear()
        self.backoffs.clear()
        if self.starts:  # the new life's first start waits one interval from its creation, not from this start
            at, least = self.starts[-1]
            self.starts[-1] = (at, min(least, self.interval))

    @invariant()
    def states_agree(self) -> None:
        expected = self.ref.state()
        for s in self.stores:
            status = s.status("q")
            got = None
            if status is not None:
                st_ = status.state
                got = (
                    st_.epoch,
                    st_.interval_us,
                    st_.ticket,
                    st_.current,
                    st_.anchor_us,
                    st_.last_start_us,
                    st_.paused,
                    st_.burst,
                    st_.quota,
                    st_.window_us,
                    st_.concurrency,
                )
            assert got == expected, (type(s).__name__, got, expected)
            if status is not None and self.limits.concurrency:
                live = sum(1 for e in self.ref.leases.values() if e > self.clock.now_us)
                assert status.in_flight == live, (type(s).__name__, status.in_flight, live)

    @invariant()
    def no_more_leases_live_than_the_cap(self) -> None:
        if self.limits.concurrency:
            live = sum(1 for e in self.ref.leases.values() if e > self.clock.now_us)
            assert live <= self.limits.concurrency, self.ref.leases

    @invariant()
    def starts_never_closer_than_the_interval(self) -> None:
        if self.limits.burst:
            return  # a burst lets starts come closer (its bound: tests/contract/test_limits_contract.py)
        for (a, least), (b, _) in zip(self.starts, self.starts[1:], strict=False):
            assert b - a >= least

    @invariant()
    def no_window_holds_more_than_the_quota(self) -> None:
        if self.limits.quota:
            starts = sorted(self.window_starts)
            for a, _ in starts:
                used = sum(c for t, c in starts if a <= t < a + self.limits.window_us)
                assert used <= self.limits.quota, (a, starts)

    @invariant()
    def nothing_starts_during_a_backoff(self) -> None:
        for first, end in self.backoffs:
            assert all(t >= end for t, _ in self.starts[first:]), (end, self.starts[first:])


REDIS_URL: list[str] = []


@pytest.mark.slow
def test_memory_sqlite_and_redis_agree_with_the_reference_model(redis_url: str) -> None:
    REDIS_URL[:] = [redis_url]
    StoresAgree.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    StoresAgree.TestCase().runTest()


# -- where the interval and the limits come from: declarations, overrides, expiry --------

NODES = ["", "a", "b", "c"]  # "": a script's declaration (siq sync), no node registered


@dataclass
class SourcesReference:
    """The deploy rules of docs/design.md ("The model": the interval's and the limits' sources),
    written independently of siq_celery.rules: per kind, an override, else the strictest
    live node declaration, else the last declaration, else what the state was created with."""

    interval: int
    limits: tuple[int, int, int, int, int]  # burst, quota, window, cap, margin
    declared: int = 0
    declared_limits: tuple[int, int, int, int, int] | None = None
    override: int = 0
    lim_override: dict[str, object] = field(default_factory=dict)  # burst, quota (n, w), conc, margin
    nodes: dict[str, tuple[int, tuple[int, int, int, int, int], int]] = field(default_factory=dict)

    def live(self, now: int) -> dict[str, tuple[int, tuple[int, int, int, int, int], int]]:
        return {n: d for n, d in self.nodes.items() if d[2] > now}

    def apply(self, now: int) -> None:
        live = self.live(now)
        self.interval = self.override or max((d[0] for d in live.values()), default=self.declared) or self.interval
        if live:
            lims = [d[1] for d in live.values()]
            quotas = [(q, w) for _, q, w, _, _ in lims if q]
            caps = [c for *_, c, _ in lims if c]
            base = (min(b for b, *_ in lims), min((q for q, _ in quotas), default=0),
                    max((w for _, w in quotas), default=0), min(caps, default=0),
                    max(m for *_, m in lims))  # fmt: skip
        else:
            base = self.declared_limits if self.declared_limits is not None else self.limits
        b, q, w, c, m = base
        o = self.lim_override
        if "burst" in o:
            b = o["burst"]  # type: ignore[assignment]
        if "quota" in o:
            q, w = o["quota"]  # type: ignore[misc]
        if "conc" in o:
            c = o["conc"]  # type: ignore[assignment]
        if "margin" in o:
            m = o["margin"]  # type: ignore[assignment]
        self.limits = (b, q, w, c, m)

    def declare(
        self, now: int, node: str, ttl: int, announce: bool, interval: int, lim: tuple[int, int, int, int, int]
    ) -> None:
        self.nodes = self.live(now)
        if node and ttl:
            self.nodes[node] = (interval, lim, now + ttl)
        elif node:
            self.nodes.pop(node, None)
        if (announce and interval != self.declared) or not self.declared:
            self.declared = interval
            if announce:
                self.override = 0
        old = self.declared_limits
        if (announce and lim != old) or old is None:
            self.declared_limits = lim
            if announce:
                for kind, i in (("burst", [0]), ("quota", [1, 2]), ("conc", [3]), ("margin", [4])):
                    if old is None or any(old[j] != lim[j] for j in i):
                        self.lim_override.pop(kind, None)
        self.apply(now)


class SourcesAgree(RuleBasedStateMachine):
    """Random declarations (worker nodes with a TTL, withdrawals, scripts; announcements and
    renewals) with limits, overrides of the interval and of each kind of limit, and clock
    moves that let declarations expire: every store gives the reference's effective
    interval and limits, declarations and overrides."""

    def __init__(self) -> None:
        super().__init__()
        run = next(_run)
        self.clock = PinnedClock()
        self.dir = tempfile.TemporaryDirectory()
        urls = [f"memory://src-{os.getpid()}-{run}", f"sqlite:///{self.dir.name}/siq.db", REDIS_URL[0]]
        self.stores = [backend_from_url(u, clock=self.clock, key_prefix=f"src{run}", ledger_max=0) for u in urls]
        self.ref: SourcesReference | None = None

    def teardown(self) -> None:
        for s in self.stores:
            s.delete("q")
            s.close()
        self.dir.cleanup()

    @rule(us=st.integers(0, 2_000_000))
    def advance(self, us: int) -> None:
        self.clock.advance(us=us)

    @rule(
        node=st.sampled_from(NODES), ttl=st.sampled_from([0, 1_000_000, 3_000_000]), announce=st.booleans(),
        interval=st.sampled_from(INTERVALS), burst=st.sampled_from([0, 1, 3]),
        quota=st.sampled_from([(0, 0), (5, 1_000_000), (10, 10_000_000)]), conc=st.sampled_from([0, 1, 4]),
        margin=st.sampled_from([0, 0, 2_000, 5_000]),
    )  # fmt: skip
    def declare(self, node: str, ttl: int, announce: bool, interval: int, burst: int, quota: tuple[int, int],
                conc: int, margin: int) -> None:  # fmt: skip
        lim = (burst, *quota, conc, margin)
        for s in self.stores:
            s.declare("q", interval, "e1", node=node, ttl_us=ttl, origin="o", announce=announce, limits=Limits(*lim))
        now = self.clock.now_us
        if self.ref is None:
            self.ref = SourcesReference(interval, lim)
        self.ref.declare(now, node, ttl, announce, interval, lim)  # type: ignore[arg-type]

    @precondition(lambda self: self.ref is not None)
    @rule(
        burst=st.sampled_from([None, 0, 2]), quota=st.sampled_from([None, (0, 0), (3, 20_000_000)]),
        conc=st.sampled_from([None, 0, 2]), margin=st.sampled_from([None, 0, 3_000]),
    )  # fmt: skip
    def set_limits(
        self, burst: int | None, quota: tuple[int, int] | None, conc: int | None, margin: int | None
    ) -> None:
        from siq_celery.types import LimitsOverride

        override = LimitsOverride(burst, *(quota or (None, 0)), conc, margin)  # type: ignore[arg-type]
        for s in self.stores:
            s.set_limits("q", override if override else None, "op")
        ref = self.ref
        assert ref is not None
        if not override:
            ref.lim_override = {}
        for kind, value in (("burst", burst), ("quota", quota), ("conc", conc), ("margin", margin)):
            if value is not None:
                ref.lim_override[kind] = value
        ref.nodes = ref.live(self.clock.now_us)
        ref.apply(self.clock.now_us)

    @precondition(lambda self: self.ref is not None)
    @rule(interval=st.sampled_from([None, *INTERVALS]))
    def set_interval(self, interval: int | None) -> None:
        for s in self.stores:
            s.set_interval("q", interval, "op")
        ref = self.ref
        assert ref is not None
        ref.override = interval or 0
        ref.nodes = ref.live(self.clock.now_us)
        ref.apply(self.clock.now_us)

    @invariant()
    def stores_agree_with_the_reference(self) -> None:
        ref = self.ref
        if ref is None:
            return
        now = self.clock.now_us
        ref.nodes = ref.live(now)
        ref.apply(now)  # what the next start uses: expired declarations no longer count
        for s in self.stores:
            status = s.status("q")
            assert status is not None
            src, state = status.sources, status.state
            o = src.limits_override
            # the margin in force is in the spacing and the window the decisions use
            margin, window = ref.limits[4], ref.limits[2]
            assert (state.interval_us, state.window_us) == (ref.interval + margin, window + margin if window else 0)
            got = (
                state.declared_interval_us, tuple(vars(state.limits).values()), src.declared_us,
                None if src.declared_limits is None else tuple(vars(src.declared_limits).values()), src.override_us,
                {k: v for k, v in (("burst", o.burst), ("quota", None if o.quota is None else (o.quota, o.window_us)),
                                   ("conc", o.concurrency), ("margin", o.margin_us)) if v is not None},
                sorted((n.node, n.interval_us, tuple(vars(n.limits).values()), n.expires_us) for n in src.nodes),
            )  # fmt: skip
            expected = (
                ref.interval, ref.limits, ref.declared, ref.declared_limits, ref.override, ref.lim_override,
                sorted((n, i, lim, e) for n, (i, lim, e) in ref.nodes.items()),
            )  # fmt: skip
            assert got == expected, (type(s).__name__, got, expected)


@pytest.mark.slow
def test_every_store_follows_the_deploy_rules_of_the_interval_and_the_limits(redis_url: str) -> None:
    REDIS_URL[:] = [redis_url]
    SourcesAgree.TestCase.settings = settings(
        max_examples=max(EXAMPLES // 2, 1),
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    SourcesAgree.TestCase().runTest()
