"""What siq_celery patches or calls of kombu's Redis transport, checked before anything is
patched: the transit guard (broker/transit.py), the unread-reply guard (broker/unread_replies.py)
and the restore sweep (broker/restore.py). A kombu that renamed one of them would leave a
guard silently off (a task lost in a BRPOP reply, a message left unread in a paused
reply, unacknowledged stamps on the host's clock): a worker of interval tasks on the Redis
broker refuses to start instead, in one line naming the kombu version and what it lacks
(tasks/worker_hooks.py), and a producer publishes without transit records, with one WARNING.

Checked from kombu 5.3 (the floor ``pyproject.toml`` declares) to the newest: kombu 5.7
added ``MultiChannelPoller._pause_brpop``, which the unread-reply guard must replace there.
"""

from __future__ import annotations

from typing import Any

#: (class in kombu.transport.redis, attributes it must define itself: what the guards
#: replace, not the base class's stand-in, attributes it may inherit: what they call).
REDIS_TRANSPORT = (
    ("Channel", ("_put", "_purge", "_delete"),
     ("_q_for_pri", "_get_message_priority", "conn_or_acquire", "priority_steps", "ack_emulation", "_in_poll",
      "unacked_key", "unacked_index_key", "visibility_timeout", "unacked_restore_limit", "qos", "client")),
    ("QoS", ("append",), ("pipe_or_acquire", "restore_visible", "can_consume")),
    ("MultiChannelPoller", ("on_readable",), ()),
)  # fmt: skip
#: From this kombu on, the poller stops watching a paused BRPOP's socket (broker/unread_replies.py).
PAUSE_BRPOP_SINCE = (5, 7)


def kombu_version() -> str:
    try:
        import kombu
    except ImportError:
        return "not installed"
    return str(getattr(kombu, "__version__", "of an unknown version"))


def missing_kombu_targets() -> list[str]:
    """What this kombu's Redis transport lacks of what siq_celery patches or calls, as
    ``kombu.transport.redis.Class.attribute`` (empty: all there, or no redis-py, so no
    Redis broker to guard)."""
    try:
        import kombu
        from kombu.transport import redis as transport
    except ImportError:
        return []
    missing = []
    for owner, own, inherited in REDIS_TRANSPORT:
        cls = getattr(transport, owner, None)
        missing += [f"{owner}.{name}" for name in own if cls is None or name not in vars(cls)]
        missing += [f"{owner}.{name}" for name in inherited if cls is None or not hasattr(cls, name)]
    if not callable(getattr(transport, "time", None)):  # its unacked stamps are swapped to the store's clock
        missing.append("time")
    version = tuple(getattr(kombu, "VERSION", (0, 0))[:2])
    poller: Any = getattr(transport, "MultiChannelPoller", None)
    if version >= PAUSE_BRPOP_SINCE and "_pause_brpop" not in vars(poller or object):
        missing.append("MultiChannelPoller._pause_brpop")
    return [f"kombu.transport.redis.{name}" for name in missing]


def kombu_problem() -> str | None:
    """None when every target is there, else the line that says what this kombu lacks."""
    missing = missing_kombu_targets()
    if not missing:
        return None
    return (
        f"kombu {kombu_version()} has no {', '.join(missing)}: siq_celery's guards of the Redis broker "
        "(broker/transit.py, broker/unread_replies.py) cannot be put in place; install a kombu from 5.3 to the "
        "newest siq_celery supports"
    )
