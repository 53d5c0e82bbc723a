"""The rules of every limit kind, as pure functions over :class:`~siq_celery.types.QueueState`.

This package is the reference semantics: the memory and SQLite stores run it inside a
transaction, and the Redis store runs its Lua twins, each beside its module by name
(``window.py`` and ``window.lua``), prepended to the scripts of ``backends/lua``; a
differential test (tests/test_differential.py) holds the twins together. All times are
integer microseconds on the store's clock. One module per limit kind (docs/design.md,
"The model"):

* :mod:`.tickets`: the line and its tickets, when each is due;
* :mod:`.spacing`: the rate cap, burst (GCRA), outages and back-offs;
* :mod:`.window`: the sliding window quota;
* :mod:`.concurrency`: the concurrency cap and the run lease;
* :mod:`.fair`: fair shares among keys (start-time fair queuing);
* :mod:`.declarations`: the interval and limits in force, from declarations and overrides;
* :mod:`.counters`: the counters of authorized starts;
* :mod:`.line`: a start, decided across every kind in one step.

The stores import the rules from here (``rules.start``, ``rules.claim``, ...).
"""

from .concurrency import (
    LEASE_GRACE_US,
    LEASE_POLL_US,
    DictLeases,
    Leases,
    RunOwner,
    give_back,
    lease_turn,
    lease_wait,
    own_start,
    read_leases,
    release_shift,
    renew_leases,
    running_copy,
    too_many_lost,
)
from .counters import (
    GAP_TOLERANCE_US,
    LAST_COUNTED,
    LATENESS_BUCKETS_US,
    counts_from_fields,
    lateness_bucket,
    start_counts,
)
from .declarations import (
    apply_sources,
    declare,
    effective_interval,
    effective_limits,
    follow_expiry,
    no_limit_known,
    override,
    override_limits,
    pin,
    set_limits,
    strictest,
)
from .fair import (
    FAIR_LOOKAHEAD_MAX,
    FAIR_LOOKAHEAD_MIN,
    FAIR_LOOKAHEAD_US,
    FAIR_SCALE,
    MAX_FAIR_WEIGHT,
    DictFairLines,
    FairLines,
    FairTurn,
    fair_check,
    fair_lookahead,
    fair_next,
    fair_promote,
    fair_push,
    fair_room,
)
from .line import (
    began,
    commit_start,
    decide,
    pause,
    restamp,
    resume,
    start,
    start_all,
)
from .spacing import (
    BEGIN_WAIT_US,
    OUTAGE_MIN_US,
    backoff,
    cap,
    charge_overtaken,
    outage_us,
    pending_wait,
    shift_after_outage,
    start_lead_us,
)
from .tickets import (
    FREE,
    claim,
    estimate_of,
    new_state,
    paused_new_state,
    release_cutoff,
    reset,
    slot_of,
)
from .window import (
    ListWindow,
    Window,
    WindowUnits,
    status_window,
    window_cutoff,
    window_slot,
    window_units,
    window_used,
)

__all__ = [
    "FREE",
    "claim",
    "estimate_of",
    "new_state",
    "paused_new_state",
    "release_cutoff",
    "reset",
    "slot_of",
    "BEGIN_WAIT_US",
    "OUTAGE_MIN_US",
    "backoff",
    "cap",
    "charge_overtaken",
    "outage_us",
    "pending_wait",
    "shift_after_outage",
    "start_lead_us",
    "ListWindow",
    "status_window",
    "Window",
    "window_cutoff",
    "window_slot",
    "window_units",
    "window_used",
    "WindowUnits",
    "LEASE_GRACE_US",
    "LEASE_POLL_US",
    "DictLeases",
    "give_back",
    "lease_turn",
    "lease_wait",
    "Leases",
    "own_start",
    "read_leases",
    "release_shift",
    "renew_leases",
    "running_copy",
    "RunOwner",
    "too_many_lost",
    "FAIR_LOOKAHEAD_MAX",
    "FAIR_LOOKAHEAD_MIN",
    "FAIR_LOOKAHEAD_US",
    "FAIR_SCALE",
    "MAX_FAIR_WEIGHT",
    "DictFairLines",
    "fair_check",
    "fair_lookahead",
    "fair_next",
    "fair_promote",
    "fair_push",
    "fair_room",
    "FairLines",
    "FairTurn",
    "apply_sources",
    "declare",
    "effective_interval",
    "effective_limits",
    "follow_expiry",
    "no_limit_known",
    "override",
    "override_limits",
    "pin",
    "set_limits",
    "strictest",
    "GAP_TOLERANCE_US",
    "LAST_COUNTED",
    "LATENESS_BUCKETS_US",
    "counts_from_fields",
    "lateness_bucket",
    "start_counts",
    "began",
    "commit_start",
    "decide",
    "pause",
    "restamp",
    "resume",
    "start",
    "start_all",
]
