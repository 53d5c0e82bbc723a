"""A body's last steps once its start is authorized: held until its slot comes on the
store's clock (:func:`hold_until`), then its report, the last step before the body, sent
as it begins (:func:`body_may_begin`; again if the process stood still since:
:func:`still_holds`, :func:`report_again_if_late`), its lease kept while it runs; a start
overtaken while the process stood still is given back (:func:`give_back_late_start`) and
waited for anew (:func:`begin_body`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..broker import green
from ..rules import BEGIN_WAIT_US
from ..types import US, Decision
from .leases import KEEPER
from .waiting import Line

logger = logging.getLogger("siq_celery")

#: A body about to begin later than this after its ask was sent reports and waits for the
#: answer (:func:`body_may_begin`): half of the time a pending start holds the queue.
LATE_BEGIN_S = BEGIN_WAIT_US / 2 / US


#: A report whose send took longer than this (the process stood still in it) is sent
#: again, until one is sent quickly (:data:`REPORTS` in all at most): the store places the
#: start when a report comes, so the last one sent counts. Never waited for: a process
#: blocked on the answer of a loaded host waits milliseconds for the CPU after it, all of
#: it between the place the store recorded and the body.
REPORT_AGAIN_S = 0.0001
REPORTS = 10


def body_may_begin(line: Line, decision: Decision, task_id: str = "") -> bool:
    """Report that the body of ``decision`` (a wait with ``reports``) begins now; the last
    step before the body. Sent without waiting (:func:`_report`), unless the authorization
    may be older than :data:`LATE_BEGIN_S` (this process stood still since it asked: a
    loaded host, a pause): then the store's answer says whether the start still holds.
    False: it does not (a later start came while this process stood still, or the store
    could not be asked); the body must not begin now, and the caller gives the start back
    and waits again. A report sent without waiting is looked at once more by
    :func:`still_holds` and :func:`report_again_if_late`, the caller's last steps."""
    _LAST_REPORT.line = _LAST_REPORT.decision = None
    hold_until(line, decision)
    if not decision.asked_at or line._monotonic() - decision.asked_at <= LATE_BEGIN_S:
        return _report(line, decision, task_id)
    try:
        held = line.began(decision, wait=True, task_id=task_id)
    except Exception as exc:  # no answer is no start (fail closed)
        logger.warning("queue %r: could not report a late body's start, waiting again: %s: %s",
                       line.name, type(exc).__name__, exc)  # fmt: skip
        return False
    if not held:
        logger.warning("queue %r: this body was about to begin %.0f ms after its start was authorized, when a "
                       "later start may have come: waiting again", line.name,
                       (line._monotonic() - decision.asked_at) * 1e3)  # fmt: skip
    return held


def hold_until(line: Line, decision: Decision) -> None:
    """A start authorized ahead of its slot (``wait_us``: how far ahead, when the store
    answered) holds its body until ``wait_us`` after the answer came back: the answer left
    the store before it came, so the body never begins before the slot on the store's
    clock (timing the hold from the ask would not know how long the ask took to get
    there, on a loaded host milliseconds), and the report reaches the store just after."""
    if decision.wait_us <= 0 or not decision.answered_at:
        return
    until = decision.answered_at + decision.wait_us / US
    if decision.slot_at:  # read against the store's clock from recent answers too: less late
        until = min(until, decision.slot_at)
    left = until - line._monotonic()
    if left > HOLD_SPIN_S and decision.slot_at and not green.GREEN:  # time.monotonic's: the last of it awake
        line._nap(left - HOLD_SPIN_S, None)
        end = min(until, time.monotonic() + HOLD_SPIN_S)
        while time.monotonic() < end:
            pass
    elif left > 0:
        line._nap(left, None)


#: A body held for its slot sleeps until this long before it, then waits the rest awake:
#: a sleep ends 50-100 µs late (the kernel's timer slack, the wake), which every start
#: would add to the line. Not on a green pool: its nap ends on time by yielding
#: (broker/green.py), and a wait awake would hold the hub.
HOLD_SPIN_S = 0.00015


def _report(line: Line, decision: Decision, task_id: str, ask: bool = False) -> bool:
    """Send the body's report, the last step before the body, without waiting for the
    answer: the store places the start when it arrives. A send that took long (over
    :data:`REPORT_AGAIN_S`: the process stood still in it, and may have stood still long
    enough for a later start to come) is followed by one whose answer is waited for
    (``ask`` starts there): False if the start no longer holds (the body must not begin
    now), else one more sent without waiting, since the process waited for that answer:
    the last quick send places the start (:data:`REPORTS` sends at most). True: the body
    may begin (also when the store could not be told: the start stands as authorized,
    and later starts wait for it :data:`BEGIN_WAIT_US` at most)."""
    for _ in range(REPORTS):
        sent = line._monotonic()
        if not ask:
            if not _tell(line, decision, task_id):
                return True
            held = True
        else:
            try:
                held = line.began(decision, wait=True, task_id=task_id)
            except Exception as exc:  # no answer is no start (fail closed), as for a late body
                logger.warning("queue %r: could not ask whether a body's start still holds, waiting again: %s: %s",
                               line.name, type(exc).__name__, exc)  # fmt: skip
                return False
        done = line._monotonic()
        if ask and not held:
            logger.warning("queue %r: this process stood still after its body's report, and a later start came: "
                           "waiting again", line.name)  # fmt: skip
            return False
        if not ask and done - sent <= REPORT_AGAIN_S:
            _LAST_REPORT.line, _LAST_REPORT.decision, _LAST_REPORT.task_id, _LAST_REPORT.sent = (
                line, decision, task_id, done,
            )  # fmt: skip
            return True
        ask = not ask  # a slow send: ask next; an answer waited for: send once more without waiting
    return True


def _tell(line: Line, decision: Decision, task_id: str) -> bool:
    """Send the body's report without waiting for the answer; False (logged) if it could
    not be sent: the start stands where the store last placed it."""
    try:
        line.began(decision, task_id=task_id)
    except Exception as exc:
        logger.warning("queue %r: could not report a body's start: %s: %s", line.name, type(exc).__name__, exc)
        return False
    return True


class _LastReport(threading.local):
    """The report this thread (greenlet, on a green pool) sent last without waiting, until
    its body begins (:func:`still_holds`, :func:`report_again_if_late`)."""

    line: Line | None = None
    decision: Decision | None = None
    task_id: str = ""
    sent: float = 0.0


_LAST_REPORT = _LastReport()


def _stood_still(decision: Decision) -> bool:
    """Whether this process stood still since it reported ``decision`` without waiting (the
    record is this thread's, or greenlet's: one that belongs to another start says nothing)."""
    last = _LAST_REPORT
    return last.decision is decision and last.line is not None and last.line._monotonic() - last.sent > REPORT_AGAIN_S


def still_holds(decision: Decision) -> bool:
    """After the caller's own steps between the report and the body (a fair queue's
    release asked of another thread, which may take the GIL): a process that stood still
    since the report of ``decision`` was sent asks whether the start still holds, as a
    slow send does (:func:`_report`). False: the body must not begin now."""
    last = _LAST_REPORT
    if not _stood_still(decision):
        return True
    assert last.line is not None
    line, task_id = last.line, last.task_id
    last.line = last.decision = None
    return _report(line, decision, task_id, ask=True)


def report_again_if_late(decision: Decision | None) -> None:
    """The very last step before a body, after the caller's own (Celery's ``before_start``,
    the ``with`` of a slot): a process that stood still since the report of ``decision``
    was sent reports again, without waiting (the body can no longer be held back here), so
    the store places the start when its body begins, while it is still the last start."""
    last = _LAST_REPORT
    line = last.line
    if line is None or decision is None or last.decision is not decision:
        return
    stood = _stood_still(decision)
    last.line = last.decision = None
    if stood:
        _tell(line, decision, last.task_id)


def begin_body(
    line: Line, ledger_id: str, wait: Callable[[], Decision], begun: Callable[[], None] | None = None
) -> Decision:
    """Wait for a start (``wait()``, asked with ``reports``) and let its body begin: its
    lease held (renewed while the body runs), then the report, the last step before the
    body (:func:`body_may_begin`), then ``begun()``: work for another thread (a fair
    queue's next release) is asked for only then, since a thread woken before the report
    takes the GIL as the report is sent, and the body waits for it after the store placed
    its start. A start overtaken while this process stood still is given back
    (:func:`give_back_late_start`) and the wait begins again, for a fresh slot. Returns the
    start the body begins on."""
    while True:
        decision = wait()
        KEEPER.hold(line.backend, line.queue_names, decision.lease, run=decision.lease == ledger_id)
        if body_may_begin(line, decision, ledger_id):
            if begun is not None:
                begun()  # the woken thread waits for the GIL: this thread holds it into the body
            if still_holds(decision):
                return decision
        KEEPER.drop(line.backend, line.queue_names, decision.lease)
        give_back_late_start(line, ledger_id, decision)


def give_back_late_start(line: Line, task_id: str, decision: Decision) -> None:
    """A start whose body did not begin (:func:`body_may_begin` said no): recorded as
    finished LATE, not remembered (the task is still to run), its lease given back. Best
    effort: a lease not given back expires."""
    try:
        line.finish(task_id, "LATE", remember=False, lease=decision.lease)
    except Exception as exc:
        logger.warning("queue %r: could not give back the late start of %s: %s", line.name, task_id, exc)
