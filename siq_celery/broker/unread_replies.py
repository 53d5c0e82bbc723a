"""No message left unread in a paused BRPOP reply on the Redis broker.

kombu's Redis transport takes a message with BRPOP: the server removes it from the list as
it sends the reply, and kombu writes it to the ``unacked`` hash (where a dead worker's
messages are found again, after ``visibility_timeout``) only once it has read the reply.
When the consumer's credit runs out while a BRPOP is pending (Celery lowers the prefetch
count each time it applies a task it held for an ETA), kombu leaves the reply unread until
credit comes back: its poller skips a readable socket while the channel cannot consume
(``MultiChannelPoller.on_readable``), and from kombu 5.7 it stops watching that socket
(``MultiChannelPoller._pause_brpop``). A message that arrives meanwhile sits in the
socket, in no list and in no hash, for as long as the node is busy. A SIGKILL then loses
it for good (every kombu from 5.3 to 5.7 alike). Interval tasks meet this often: a deferral is a
new message with an ETA, and a waiting task holds credit. Seen in the fault suite: one
task of 200 never ran after a node was killed (a deferral's new message, popped by the
node in its last second).

:func:`guard_unread_replies` changes kombu's poller so that a reply that arrives while
the channel has no credit is read at once and its message put back at the head of the
queue it came from (``RPUSH``: BRPOP takes from the right), untouched: a live consumer
takes it the moment any credit returns. The window left is the one kombu always has,
between reading a reply and writing the hash: microseconds, not seconds.
"""

from __future__ import annotations

import logging
from typing import Any

from .kombu_api import missing_kombu_targets

logger = logging.getLogger("siq_celery")


def guard_unread_replies() -> bool:
    """Patch kombu's Redis poller (once per process). True if the guard is in place (False:
    no redis-py, or a kombu without what it patches: broker/kombu_api.py, where a worker of
    interval tasks refuses to start)."""
    try:
        from kombu.transport import redis as transport
    except ImportError:  # no redis-py: no Redis broker either
        return False
    poller: Any = transport.MultiChannelPoller
    if getattr(poller, "_siq_guarded", False):
        return True
    if missing_kombu_targets():  # nothing patched half-way
        return False
    original = poller.on_readable

    def on_readable(self: Any, fileno: int) -> Any:
        chan_type = self._fd_to_chan.get(fileno)  # (never paused: see never_pause)
        if chan_type is not None:
            chan, kind = chan_type
            if kind == "BRPOP" and chan._in_poll and not chan.qos.can_consume():
                put_back_pending_reply(chan)
                return None
        return original(self, fileno)

    def never_pause(self: Any, channel: Any, fileno: int) -> None:
        """The socket stays watched: a reply is read (and put back) as it arrives."""

    poller.on_readable = on_readable
    if hasattr(poller, "_pause_brpop"):  # kombu 5.7 on (where missing_kombu_targets requires it)
        poller._pause_brpop = never_pause
    poller._siq_guarded = True
    return True


def put_back_pending_reply(channel: Any) -> None:
    """Read ``channel``'s pending BRPOP reply; a message in it goes back where BRPOP took it
    from (its queue's list, priority included), first in line. No new BRPOP is sent until
    the channel has credit again (kombu's ``on_poll_start``)."""
    client = channel.client
    try:
        try:
            reply = client.parse_response(client.connection, "BRPOP")
        except channel.connection_errors:
            client.connection.disconnect()  # as kombu's own read does: the next cycle reconnects
            raise
        if reply:
            key, item = reply
            key = key.decode() if isinstance(key, bytes) else key  # the client adds its key prefix again
            client.rpush(key, item)
            logger.debug("siq_celery: a message taken while the consumer had no credit went back to %r", key)
    finally:
        channel._in_poll = None
