"""Where the interval and the limits come from: the code's declarations (one per live
worker node, and the last one announced) and an operator's overrides, kind by kind
(docs/design.md, "The model"). A queue runs at the override if set, else the slowest
interval and the strictest limits of the live nodes, else the last declaration.

Twin: ``declarations.lua`` beside this module. Times in integer microseconds, store's clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..limits import NO_SPACING_US
from ..types import (
    NO_LIMITS,
    NO_OVERRIDE,
    Declared,
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    QueueState,
)


def _limit_fields(limits: Limits) -> tuple[int, int, int, int, int]:
    quota = limits.quota if limits.window_us > 0 else 0
    return (max(limits.burst, 0), max(quota, 0), limits.window_us if quota > 0 else 0, max(limits.concurrency, 0),
            max(limits.margin_us, 0))  # fmt: skip


def set_limits(state: QueueState, limits: Limits) -> None:
    """The code declares other limits (mutates ``state``). A smaller burst takes its
    credit away at once (the theoretical arrival time is kept, so the cap moves later),
    a larger one gives credit as the line runs. A smaller concurrency cap holds new starts
    until enough running bodies give their leases back; none is taken away. The margin is
    added to the interval and the window in force (``interval_us``, ``window_us``): every
    decision spaces starts and counts windows with it."""
    interval = state.declared_interval_us
    state.burst, state.quota, window, state.concurrency, state.margin_us = _limit_fields(limits)
    state.interval_us = interval + state.margin_us
    state.window_us = window + state.margin_us if state.quota else 0


def no_limit_known(state: QueueState) -> bool:
    """No spacing, no quota and no cap: a queue paused before any declaration, which must
    not resume into running unlimited (a declaration or an operator's interval first)."""
    return state.interval_us <= NO_SPACING_US and not state.quota and not state.concurrency


def effective_interval(sources: IntervalSources, now_us: int) -> int:
    """The interval a queue runs at: an operator's override if set; else the slowest
    declaration of the live worker nodes (during a rolling deploy, old and new code side
    by side, the queue never runs faster than either); else the last declaration. 0: none
    of these (the interval stays as stored)."""
    if sources.override_us:
        return sources.override_us
    return max((n.interval_us for n in sources.live(now_us)), default=sources.declared_us)


def strictest(declared: Sequence[Limits]) -> Limits:
    """The limits at least as strict as each of ``declared`` (at least one), kind by kind:
    the smallest burst; a quota if any declares one, of the smallest N over the longest
    window among those that do (N' = min N in any W' = max W allows no more than any of
    them in its own window: at most N' <= N_i starts in W' >= W_i); the smallest
    concurrency cap among those that declare one (0, no cap, is the least strict)."""
    quotas = [(d.quota, d.window_us) for d in declared if d.quota > 0 and d.window_us > 0]
    caps = [d.concurrency for d in declared if d.concurrency > 0]
    return Limits(
        min(d.burst for d in declared),
        min(n for n, _ in quotas) if quotas else 0,
        max(w for _, w in quotas) if quotas else 0,
        min(caps, default=0),
        max(d.margin_us for d in declared),
    )


def effective_limits(sources: IntervalSources, now_us: int, stored: Limits) -> Limits:
    """The limits a queue runs at, kind by kind: an operator's override of that kind if
    set; else the strictest of the live worker nodes' declarations (a rolling deploy runs
    at the stricter code: :func:`strictest`); else the last declaration; else ``stored``
    (nothing declared: what the state was created with). Live nodes of an earlier version,
    which declared no limits, have no say."""
    live = [n.limits for n in sources.live(now_us) if n.limits is not None]
    declared = sources.declared_limits if sources.declared_limits is not None else stored
    base = strictest(live) if live else declared
    return _normal(sources.limits_override.apply(base))


def _normal(limits: Limits) -> Limits:
    return Limits(*_limit_fields(limits))


def apply_sources(state: QueueState, sources: IntervalSources, now_us: int) -> None:
    """The state runs at what its sources give (mutates ``state``): the effective interval
    (:func:`effective_interval`; none: the stored one stays) and limits
    (:func:`effective_limits`)."""
    state.interval_us = (effective_interval(sources, now_us) or state.declared_interval_us) + state.margin_us
    set_limits(state, effective_limits(sources, now_us, state.limits))


def follow_expiry(state: QueueState, sources: IntervalSources, now_us: int) -> IntervalSources | None:
    """The effective interval and limits follow the expiry of node declarations: when a
    stored node declaration has expired (a node that died, or missed its renewals), they
    are recomputed from the live ones and the expired ones are dropped; the new sources,
    or None when nothing expired (mutates ``state``). Every operation that decides by the
    interval runs it first, so a killed node's declaration stops counting exactly its TTL
    after its last renewal, on the store's clock, whether or not a live node declares in
    between. (The Lua scripts keep the earliest expiry in the state instead of reading the
    sources each time: ``siq_follow_expiry``.)"""
    if all(n.expires_us > now_us for n in sources.nodes):
        return None
    live = replace(sources, nodes=sources.live(now_us))
    apply_sources(state, live, now_us)
    return live


def _kinds_changed(old: Limits | None, new: Limits) -> LimitsOverride:
    """The kinds (as a :class:`LimitsOverride` whose set kinds are the changed ones, valued
    0) in which declaration ``new`` differs from ``old`` (None: every kind)."""
    return LimitsOverride(
        0 if old is None or old.burst != new.burst else None,
        0 if old is None or (old.quota, old.window_us) != (new.quota, new.window_us) else None,
        0,
        0 if old is None or old.concurrency != new.concurrency else None,
        0 if old is None or old.margin_us != new.margin_us else None,
    )


def _drop_kinds(override: LimitsOverride, kinds: LimitsOverride) -> tuple[LimitsOverride, LimitsOverride]:
    """(``override`` without the kinds set in ``kinds``, the part of it dropped)."""
    keep = LimitsOverride(
        override.burst if kinds.burst is None else None,
        override.quota if kinds.quota is None else None,
        override.window_us if kinds.quota is None else 0,
        override.concurrency if kinds.concurrency is None else None,
        override.margin_us if kinds.margin_us is None else None,
    )
    dropped = LimitsOverride(
        None if kinds.burst is None else override.burst,
        None if kinds.quota is None else override.quota,
        0 if kinds.quota is None or override.quota is None else override.window_us,
        None if kinds.concurrency is None else override.concurrency,
        None if kinds.margin_us is None else override.margin_us,
    )
    return keep, dropped


def _normal_override(override: LimitsOverride | None) -> LimitsOverride | None:
    """A negative value sets nothing (the Lua scripts' -1); a quota without a window is none."""
    if override is None:
        return None
    burst = override.burst if override.burst is not None and override.burst >= 0 else None
    concurrency = override.concurrency if override.concurrency is not None and override.concurrency >= 0 else None
    quota, window = override.quota, override.window_us
    if quota is not None and quota < 0:
        quota, window = None, 0
    elif quota is not None and (quota == 0 or window <= 0):
        quota, window = 0, 0
    margin = override.margin_us if override.margin_us is not None and override.margin_us >= 0 else None
    return LimitsOverride(burst, quota, window if quota is not None else 0, concurrency, margin)


def declare(
    state: QueueState,
    sources: IntervalSources,
    now_us: int,
    interval_us: int,
    *,
    node: str = "",
    ttl_us: int = 0,
    origin: str = "",
    announce: bool = True,
    limits: Limits = NO_LIMITS,
) -> tuple[IntervalSources, Declared]:
    """The code declares ``interval_us`` and ``limits`` for the queue (mutates ``state``).

    ``node`` (a worker's name) registers or renews its declaration for ``ttl_us`` (0:
    withdraws it, a worker shutting down); expired ones are dropped. ``announce`` (a
    worker starting, ``siq sync``) makes a declaration that differs from the last one the
    new declaration, replacing any override of what changed (the interval's override when
    the interval changed; of the limits, the override of each kind that changed): a deploy
    that changes the code wins over an earlier runtime change. A renewal never changes
    the declaration, so old and new workers side by side do not flip it back and forth.
    Then the effective interval and limits are recomputed (:func:`apply_sources`)."""
    limits = _normal(limits)
    nodes = {n.node: n for n in sources.live(now_us)}
    if node:
        if ttl_us > 0:
            nodes[node] = NodeDeclaration(node, interval_us, now_us + ttl_us, limits)
        else:
            nodes.pop(node, None)
    new = replace(sources, nodes=tuple(sorted(nodes.values(), key=lambda n: n.node)))
    replaced_us, replaced_by = 0, ""
    if (announce and interval_us != sources.declared_us) or not sources.declared_us:
        new = replace(new, declared_us=interval_us, declared_by=origin, declared_at_us=now_us)
        if announce and sources.override_us:
            replaced_us, replaced_by = sources.override_us, sources.override_by
            new = replace(new, override_us=0, override_by="", override_at_us=0)
    replaced_limits, replaced_limits_by = NO_OVERRIDE, ""
    if (announce and limits != sources.declared_limits) or sources.declared_limits is None:
        new = replace(new, declared_limits=limits)
        if announce and sources.limits_override:
            changed = _kinds_changed(sources.declared_limits, limits)
            kept, replaced_limits = _drop_kinds(sources.limits_override, changed)
            if replaced_limits:
                replaced_limits_by = sources.limits_override_by
                new = replace(new, limits_override=kept)
                if not kept:
                    new = replace(new, limits_override_by="", limits_override_at_us=0)
    old_interval, old_limits = state.interval_us, state.limits
    apply_sources(state, new, now_us)
    done = Declared(
        False, sources.declared_us, new.declared_us, old_interval, state.interval_us, replaced_us, replaced_by,
        sources.declared_limits, new.declared_limits, old_limits, state.limits, replaced_limits, replaced_limits_by,
    )  # fmt: skip
    return new, done


def pin(sources: IntervalSources, now_us: int, interval_us: int, origin: str = "") -> IntervalSources:
    """A reset that names an interval (``siq reset --interval``, ``ensure(reset=True)``):
    the caller wants that interval now, so it must not be undone by the next renewal of
    the workers' declarations. It becomes the declaration when there is none, clears the
    override when the declarations give it anyway, and is the override otherwise."""
    if not sources.declared_us and not sources.nodes:
        return replace(sources, declared_us=interval_us, declared_by=origin, declared_at_us=now_us)
    if interval_us == effective_interval(replace(sources, override_us=0), now_us):
        return replace(sources, override_us=0, override_by="", override_at_us=0)
    return replace(sources, override_us=interval_us, override_by=origin, override_at_us=now_us)


def override(
    state: QueueState, sources: IntervalSources, now_us: int, interval_us: int | None, origin: str = ""
) -> IntervalSources:
    """An operator sets the queue's interval at runtime (``interval_us``), or clears an
    override (None): back to what the code declares (mutates ``state``). The override
    holds across worker restarts whose declaration is unchanged."""
    if interval_us:
        new = replace(sources, override_us=interval_us, override_by=origin, override_at_us=now_us)
    else:
        new = replace(sources, override_us=0, override_by="", override_at_us=0)
    apply_sources(state, new, now_us)
    return new


def override_limits(
    state: QueueState, sources: IntervalSources, now_us: int, override: LimitsOverride | None, origin: str = ""
) -> IntervalSources:
    """An operator overrides some of the queue's limits at runtime (the kinds ``override``
    sets; the others keep theirs, overridden or not), or clears every override of them
    (None): back to what the code declares (mutates ``state``). The override holds across
    worker restarts whose declaration of a kind is unchanged; an announcement that changes
    a kind replaces its override (:func:`declare`)."""
    override = _normal_override(override)
    if override:
        merged = sources.limits_override.merged(override)
        new = replace(sources, limits_override=merged, limits_override_by=origin, limits_override_at_us=now_us)
    else:
        new = replace(sources, limits_override=NO_OVERRIDE, limits_override_by="", limits_override_at_us=0)
    apply_sources(state, new, now_us)
    return new
