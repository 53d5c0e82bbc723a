"""No interval task lost between the Redis broker's list and a consumer's unacked hash.

kombu's Redis transport takes a message with BRPOP: the server removes it from the list
as it sends the reply, and kombu writes it to the ``unacked`` hash (where a dead worker's
messages are found again, after ``visibility_timeout``) only once it has read and parsed
the reply. A consumer SIGKILLed in between loses the message for good. The window is
short on a quiet host and grows with load; an interval queue crosses it often (every
deferral is a new message). Measured before this module: a killed node of the fault
suite lost a task in about 1 run in 10 beside a full test suite.

So every message of an interval task (it carries a ``siq_queue`` header) has a *transit
record* on the broker, written with the message in one MULTI by the producer
(:func:`guard_transit` patches kombu's ``Channel._put``), and deleted by the consumer in
the very pipeline that writes the message to the unacked hash (kombu's ``QoS.append``).
A record outliving both means the message is in a list still, or was lost in a reply.
Each worker's upkeep (:class:`TransitSweep`, every round) looks at records older than
``grace`` seconds, a few hundred at a time, in one Lua script each call:

* the message is still in its list (``LPOS`` from the oldest end), or the list is too long
  to tell: look again later, at twice its age (a backlog is scanned log-many times);
* it is in no list: marked suspect and looked at again ``grace`` seconds later (a live
  consumer between BRPOP and its unacked write takes microseconds, so it will have
  deleted the record by then); still in no list then: put back first in its list
  (``RPUSH``: BRPOP takes from the right), as kombu restores, and the record dropped.

Putting a message back when its consumer was alive after all (stalled for more than
``grace`` between reading the reply and writing the hash) makes a second copy: the gate's
run lease and finished records answer it ``RUNNING`` or ``DUPLICATE`` (docs/design.md,
"The guarantees": crashes), as for a broker redelivery. Purging or deleting a queue drops
its records in the same atomic step, so a purge stays a purge, in a process where the guard
is installed (task.install: once an interval task has bound to an app, as in a worker or
a producer that used one; and every ``celery`` command, which loads the ``siq`` command:
cli/celery_command.py, so ``celery -A app purge`` too).

Not covered: a transport without ack emulation (``ack_emulation=False``: no unacked hash,
so no records are written), a consumer with ``no_ack`` (its messages' records end only by
being put back once), kombu's batched publish (a pipeline, not a MULTI: a failed flush may
leave a record whose message the producer saw fail), and a message restored by kombu
(``visibility_timeout``) or put back here (it travels on without a record). Upgrade the
workers before the producers: a worker of an earlier version deletes no records, so what
it takes is put back once by the others (and refused by the gate).

Cost: a publish of an interval task writes the payload twice (list and record) in the
same round trip; a consumer deletes the record in the round trip it already makes.
Other messages are untouched.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..clock import store_time
from .kombu_api import kombu_problem
from .restore import BrokerSweep

logger = logging.getLogger("siq_celery")

#: Hash: delivery tag -> the payload exactly as pushed to the list.
TRANSIT = "siq:transit"
#: Hash: delivery tag -> "<publish time, s> <list key>".
TRANSIT_WHERE = "siq:transit:where"
#: Sorted set: delivery tag -> when the sweep looks at it next (s, the broker's clock).
TRANSIT_DUE = "siq:transit:due"
#: Sorted set: delivery tags found in no list once (when).
TRANSIT_SUSPECT = "siq:transit:suspect"
KEYS = (TRANSIT, TRANSIT_WHERE, TRANSIT_DUE, TRANSIT_SUSPECT)

#: A record is looked at first this long after its publish, and a suspect confirmed this
#: long after it was found in no list: a consumer stalled longer than this between reading
#: a reply and writing the unacked hash may see its message delivered again.
GRACE_S = 5.0
#: LPOS scans at most this many elements from the oldest end of a list; a longer list
#: whose oldest elements do not hold the message cannot tell: looked at again later.
SCAN_AT_MOST = 1_000
#: Records looked at per script call (and calls per sweep).
BATCH = 200
CALLS_PER_SWEEP = 5

SWEEP = """
local transit, where, due, suspect = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, grace, scan, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local tags = redis.call('ZRANGE', due, '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
local restored, looked = 0, 0
for _, tag in ipairs(tags) do
  looked = looked + 1
  local payload = redis.call('HGET', transit, tag)
  local place = redis.call('HGET', where, tag)
  if not payload or not place then
    redis.call('HDEL', transit, tag)
    redis.call('HDEL', where, tag)
    redis.call('ZREM', due, tag)
    redis.call('ZREM', suspect, tag)
  else
    local space = string.find(place, ' ', 1, true)
    local published = tonumber(string.sub(place, 1, space - 1))
    local key = prefix .. string.sub(place, space + 1)
    local queued = redis.call('LPOS', key, payload, 'RANK', -1, 'MAXLEN', scan)
    if queued or redis.call('LLEN', key) > scan then
      redis.call('ZADD', due, now + math.max(grace, now - published), tag)
      redis.call('ZREM', suspect, tag)
    elseif not redis.call('ZSCORE', suspect, tag) then
      redis.call('ZADD', suspect, now, tag)
      redis.call('ZADD', due, now + grace, tag)
    else
      redis.call('RPUSH', key, payload)
      redis.call('HDEL', transit, tag)
      redis.call('HDEL', where, tag)
      redis.call('ZREM', due, tag)
      redis.call('ZREM', suspect, tag)
      restored = restored + 1
    end
  end
end
return {looked, restored}
"""


DROP = """
local transit, where, due, suspect = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, gone, count = ARGV[1], {}, 0
for i = 2, #ARGV do
  gone[ARGV[i]] = true
  count = count + redis.call('LLEN', prefix .. ARGV[i])
  redis.call('DEL', prefix .. ARGV[i])
end
local places = redis.call('HGETALL', where)
for i = 1, #places, 2 do
  local place = places[i + 1]
  if gone[string.sub(place, string.find(place, ' ', 1, true) + 1)] then
    redis.call('HDEL', transit, places[i])
    redis.call('HDEL', where, places[i])
    redis.call('ZREM', due, places[i])
    redis.call('ZREM', suspect, places[i])
  end
end
return count
"""


def ticketed(payload: Any) -> bool:
    """Whether a kombu message payload is an interval task's (it carries a ticket)."""
    headers = payload.get("headers") if isinstance(payload, dict) else None
    return isinstance(headers, dict) and headers.get("siq_queue") is not None


def guard_transit() -> bool:
    """Patch kombu's Redis transport (once per process) so that the messages of interval
    tasks carry a transit record from publish to the consumer's unacked hash. True if the
    guard is in place (False: no redis-py, so no Redis broker; or a kombu without what it
    patches: broker/kombu_api.py, where a worker refuses to start and a producer's first
    publish says so in a WARNING)."""
    try:
        from kombu.transport import redis as transport
        from kombu.transport import virtual
    except ImportError:
        return False
    channel: Any = transport.Channel
    if getattr(channel, "_siq_transit", False):
        return True
    if kombu_problem() is not None:  # nothing patched half-way
        return False
    from kombu.utils import json

    dumps: Any = json.dumps
    qos: Any = transport.QoS
    base_qos: Any = virtual.QoS
    original_put, original_append, original_delete = channel._put, qos.append, channel._delete

    def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> Any:
        # Without ack emulation (or for a consumer with no_ack) kombu writes no unacked
        # hash, so nothing would end a record: no records there.
        if not (ticketed(message) and self.ack_emulation):
            return original_put(self, queue, message, **kwargs)
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        payload, tag = dumps(message), message["properties"]["delivery_tag"]
        commands: list[tuple[Any, ...]] = [  # the record before the message: a message is never without it
            ("hset", TRANSIT, tag, payload),
            ("hset", TRANSIT_WHERE, tag, f"{time.time():.6f} {key}"),
            ("zadd", TRANSIT_DUE, {tag: time.time() + GRACE_S}),
            ("lpush", key, payload),
        ]
        expires = getattr(self, "_expires", None)  # a queue's x-expires, kombu 5.7 on
        if expires and queue in expires:
            commands += [("pexpire", self._q_for_pri(queue, p), expires[queue]) for p in self.priority_steps]
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:  # kombu's batched publish (one pipeline for many messages)
            for name, *args in commands:
                batch.add(name, *args)
            return None
        with self.conn_or_acquire() as client, client.pipeline(transaction=True) as pipe:
            for name, *args in commands:
                getattr(pipe, name)(*args)
            pipe.execute()
        return None

    def append(self: Any, message: Any, delivery_tag: str) -> None:
        if not ticketed(message._raw):
            return original_append(self, message, delivery_tag)  # type: ignore[no-any-return]
        delivery = message.delivery_info
        record = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:  # kombu's own write, and the record's end in the same round trip
            pipe.zadd(self.unacked_index_key, {delivery_tag: store_time()})
            pipe.hset(self.unacked_key, delivery_tag, record)
            pipe.hdel(TRANSIT, delivery_tag).hdel(TRANSIT_WHERE, delivery_tag)
            pipe.zrem(TRANSIT_DUE, delivery_tag).zrem(TRANSIT_SUSPECT, delivery_tag)
            pipe.execute()
        base_qos.append(self, message, delivery_tag)
        return None

    def _purge(self: Any, queue: str) -> int:
        """kombu's purge (the lists deleted, their lengths counted), and the records of
        what it purged dropped in the same atomic step."""
        return drop_lists(self, queue)

    def _delete(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
        result = original_delete(self, queue, *args, **kwargs)
        drop_lists(self, queue)  # a sweep puts back nothing it did not find missing twice, a grace apart
        return result

    channel._put, channel._purge, channel._delete, qos.append = _put, _purge, _delete, append
    # kombu's own unacked stamps and restore_visible's cutoff read its module's ``time``:
    # on the store's clock, like ours above, so that workers whose clocks differ agree.
    transport.time = store_time  # type: ignore[attr-defined]
    channel._siq_transit = True
    return True


def drop_lists(channel: Any, queue: str) -> int:
    """Delete ``queue``'s lists (every priority) and the transit records of messages bound
    for them, in one atomic step; the number of messages the lists held."""
    with channel.conn_or_acquire() as client:
        prefix = getattr(channel, "global_keyprefix", "") or ""
        lists = sorted({channel._q_for_pri(queue, p) for p in channel.priority_steps})
        keys = [prefix + key for key in KEYS]
        return int(_plain(client).eval(DROP, len(keys), *keys, prefix, *lists))


def _plain(client: Any) -> Any:
    """A redis-py client on ``client``'s pool that adds no key prefix (kombu's
    ``global_keyprefix`` client prefixes only the commands it knows)."""
    import redis

    return redis.Redis(connection_pool=client.connection_pool)


class TransitSweep(BrokerSweep):
    """Puts back the messages of interval tasks lost in a BRPOP reply (see the module)."""

    what = "the transit sweep"

    def __init__(self, app: Any, *, grace: float = GRACE_S) -> None:
        self.app, self.grace = app, grace
        self._script: Any = None

    def sweep(self) -> int:
        """One sweep: the number of messages put back. Raises what the broker raised
        (the connection is dropped first)."""
        try:
            channel = self._default_channel(self.app)
            prefix = getattr(channel, "global_keyprefix", "") or ""
            with channel.conn_or_acquire() as client:
                plain = _plain(client)
                if self._script is None:
                    self._script = plain.register_script(SWEEP)
                restored = 0
                for _ in range(CALLS_PER_SWEEP):
                    keys, args = [prefix + key for key in KEYS], [prefix, self.grace, SCAN_AT_MOST, BATCH]
                    looked, back = self._script(keys=keys, args=args, client=plain)
                    restored += int(back)
                    if int(looked) < BATCH:
                        break
                return restored
        except Exception:
            self.close()
            raise
