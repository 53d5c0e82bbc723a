"""Every Redis URL form reaches a real server: Unix socket, ACL user/password, Sentinel.

(Cluster is covered by the contract suite; TLS has its own test with a TLS server.)
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from siq_celery import ConfigurationError, IntervalQueue, StoreUnavailableError
from siq_celery.backends import backend_from_url
from siq_celery.backends.redis import ACL_RULES
from siq_celery.embedded import EmbeddedRedis, free_port, redis_server_binary
from siq_celery.parked import FairBacklog, FairTask


def exercise(url: str) -> None:
    q = IntervalQueue("urls", url=url, interval="10ms")
    q.ensure(reset=True)
    with q.slot() as decision:
        assert decision.authorized
    assert q.status().state.current == 1
    assert q.claim_later().ticket().number == 2  # a publish's claim: the thread's own connection
    q.delete()
    q.close()


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with EmbeddedRedis(extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")):
        exercise(f"unix://{sock}?db=0")


def test_acl_user_and_password_url(redis_server: EmbeddedRedis, redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    # Exactly the documented ACL: siq_celery's scripts and commands on its own keys.
    admin.execute_command("ACL", "SETUSER", "siq", "reset", "on", ">s3cret", *ACL_RULES)
    admin.execute_command("ACL", "SETUSER", "narrow", "reset", "on", ">s3cret", "~siq:*", "+evalsha", "+eval")
    try:
        exercise(f"redis://siq:s3cret@127.0.0.1:{redis_server.port}/0")
        with pytest.raises(StoreUnavailableError):
            exercise(f"redis://siq:wrong@127.0.0.1:{redis_server.port}/0")
        with pytest.raises(ConfigurationError, match="ACL SETUSER"):
            exercise(f"redis://narrow:s3cret@127.0.0.1:{redis_server.port}/0")
    finally:
        admin.execute_command("ACL", "DELUSER", "siq", "narrow")


def test_fair_shares_and_their_backlog_need_no_more_than_the_documented_acl(
    redis_server: EmbeddedRedis, redis_url: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "siqfair", "reset", "on", ">s3cret", *ACL_RULES)
    backend = backend_from_url(f"redis://siqfair:s3cret@127.0.0.1:{redis_server.port}/0")
    try:
        backend.fair_park("fair", "A", 1, [FairTask("a0", "{}"), FairTask("a1", "{}")], 10_000, "e1")
        backend.fair_park("fair", "B", 2, [FairTask("b0", "{}")], 10_000, "e1")
        assert backend.fair_backlog("fair", top=1) == FairBacklog(2, 3, (("A", 2, 1),))
        assert len(backend.release("fair", 60_000_000).tasks) == 3  # each line popped to its end
        assert backend.fair_backlog("fair") == FairBacklog() and backend.delete("fair")
    finally:
        backend.close()
        admin.execute_command("ACL", "DELUSER", "siqfair")


#: The ACL the previous release documented (before fair shares).
ACL_BEFORE_FAIR_SHARES = tuple(
    rule for rule in ACL_RULES if rule not in ("+rpush", "+lpop", "+llen", "+hexists", "+hlen")
)


def test_a_user_on_the_acl_before_fair_shares_still_runs_and_reads_other_queues(
    redis_server: EmbeddedRedis, redis_url: str
) -> None:
    """An upgrade does not break a restricted user whose ACL predates fair shares: the
    commands fair shares added run only for a queue that has some (status, the exporter's
    reads and siq top read every queue)."""
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "siqold", "reset", "on", ">s3cret", *ACL_BEFORE_FAIR_SHARES)
    try:
        exercise(f"redis://siqold:s3cret@127.0.0.1:{redis_server.port}/0")
        backend = backend_from_url(f"redis://siqold:s3cret@127.0.0.1:{redis_server.port}/0")
        try:
            q = IntervalQueue("old-acl", backend=backend, interval="1ms")
            q.ensure(reset=True)
            with q.slot(task_id="t1"):
                pass
            assert backend.status("old-acl").state.current == 1
            assert backend.release("old-acl", 60_000_000).tasks == []
            assert backend.delete("old-acl")
        finally:
            backend.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "siqold")


@pytest.fixture
def sentinel(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[int]:
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\nsentinel monitor mymaster 127.0.0.1 {redis_server.port} 1\n"
    )
    proc = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster"):
                    break
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


def test_sentinel_url(sentinel: int, redis_url: str) -> None:
    exercise(f"redis+sentinel://127.0.0.1:{sentinel}/mymaster/0")


def test_a_start_leaves_a_master_sentinel_no_longer_names(
    sentinel: int, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before a start or a finish (at most every MASTER_CHECK_S), a Sentinel client asks a
    sentinel which master it names; another address than its connections reach (a master
    back from a partition, not yet demoted) drops them all, and the start goes to the one
    Sentinel names. Here the sentinel is made to name another server once."""
    from siq_celery.backends import redis_client as store

    q = IntervalQueue("check-master", url=f"redis+sentinel://127.0.0.1:{sentinel}/mymaster/0", interval="1ms")
    q.ensure(reset=True)
    with q.slot():
        pass
    pool = q.backend.client.connection_pool  # type: ignore[attr-defined]
    sentinel_client = pool.sentinel_manager.sentinels[0]
    real, asked = sentinel_client.execute_command, []

    def answer(*args: object, **kwargs: object) -> object:
        reply = real(*args, **kwargs)
        if args[0] == "SENTINEL MASTER":
            asked.append(args)
            if len(asked) == 1:  # as if a replica on port 1 had been promoted
                reply = {**reply, "port": 1, "config-epoch": reply["config-epoch"] + 1}
        return reply

    sentinel_client.execute_command = answer
    old = [c._sock for c in pool._available_connections if c._sock is not None]  # kept: ids stay theirs
    assert old
    q.backend._master_checked = -store.MASTER_CHECK_S  # type: ignore[attr-defined]
    with caplog.at_level("WARNING", logger="siq_celery"), q.slot():
        pass
    assert "names 127.0.0.1:1 the master of 'mymaster'" in caplog.text
    now = {id(c._sock) for c in pool._available_connections}
    assert not {id(s) for s in old} & now, "the connections it had were dropped"
    for _ in range(3):
        with q.slot():  # the first asks again (the new connection is checked), then not for MASTER_CHECK_S
            pass
    assert len(asked) == 2
    # The sentinels fail the master over: nothing starts on it meanwhile (the start retries).
    asked.clear()

    def failing_over(*args: object, **kwargs: object) -> object:
        reply = real(*args, **kwargs)
        if args[0] == "SENTINEL MASTER":
            asked.append(args)
            if len(asked) <= 2:
                reply = {**reply, "flags": "s_down,o_down,master,failover_in_progress"}
        return reply

    sentinel_client.execute_command = failing_over
    q.backend._master_checked = -store.MASTER_CHECK_S  # type: ignore[attr-defined]
    caplog.clear()
    with caplog.at_level("WARNING", logger="siq_celery"), q.slot(timeout=5):
        pass
    assert caplog.text.count("Sentinel is failing over 'mymaster'") == 2
    assert len(asked) == 3
    assert q.status().state.current == 6
    q.delete()
    q.close()


def test_a_sentinel_urls_commands_give_a_hung_master_up_in_a_second() -> None:
    """A master stopped or cut off hangs its clients until their socket timeout: on a
    Sentinel URL that is 1 s (plus the replica wait with siq_store_replicas), so retries
    reach the promoted replica soon after the promotion; the sentinels' own connections
    are bounded too. A timeout in the URL still wins. (No server: nothing connects yet.)"""
    from siq_celery.backends.redis import RedisBackend

    def timeouts(url: str, **options: object) -> tuple[object, object, object]:
        client = RedisBackend.from_url(url, **options).client
        kwargs = client.connection_pool.connection_kwargs
        sentinel_kwargs = client.connection_pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
        return kwargs["socket_timeout"], sentinel_kwargs["socket_timeout"], sentinel_kwargs["socket_connect_timeout"]

    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/0"
    assert timeouts(url) == (1.0, 1.0, 2.0)
    assert timeouts(url, replicas=1, replica_timeout_ms=500) == (1.5, 1.5, 2.0)
    assert timeouts(url + "?socket_timeout=7") == (7.0, 7.0, 2.0)
    plain = RedisBackend.from_url("redis://127.0.0.1:1/0").client
    assert plain.connection_pool.connection_kwargs["socket_timeout"] == 5.0


def test_the_documented_acl_is_the_one_the_code_needs() -> None:
    from pathlib import Path

    from siq_celery.backends.redis import ACL_RULES

    page = (Path(__file__).resolve().parent.parent / "docs" / "stores.md").read_text()
    assert f"ACL SETUSER siq on >PASSWORD {' '.join(ACL_RULES)}\n" in page


def test_claims_sent_while_others_are_unread_each_get_their_own_reply(redis_url: str) -> None:
    """A publish inside a publish (or two threads, or two greenlets): the first claim's
    connection still waits for its reply, so the second opens another; each reply reaches
    its own claim, read in any order, and both connections serve later claims. redis-py's
    pool is not involved (its checkout costs as much as the claim)."""
    q = IntervalQueue("nested", url=redis_url, interval="10ms")
    q.ensure()
    first = q.claim()
    pool = q.backend.client.connection_pool  # type: ignore[attr-defined]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a claim took a connection of redis-py's pool")

    pool.get_connection = refuse
    try:
        outer = q.backend.claim_later(q.name, 1, q.interval_us, first.epoch)
        inner = q.backend.claim_later(q.name, 1, q.interval_us, first.epoch)
        innermost = q.backend.claim_later(q.name, 1, q.interval_us, first.epoch)
        assert inner.result().first == first.number + 2
        assert innermost.result().first == first.number + 3
        assert outer.result().first == first.number + 1
        assert len(q.backend._spare) == 3  # type: ignore[attr-defined]
        assert [q.claim_later().ticket().number for _ in range(4)] == [first.number + n for n in range(4, 8)]
        assert len(q.backend._spare) == 3  # type: ignore[attr-defined]
    finally:
        del pool.get_connection
    q.close()


def test_the_claim_goes_on_the_wire_as_redis_py_would_send_it(redis_url: str) -> None:
    """A publish's claim is encoded once per queue and only its epoch is written anew
    (RedisBackend._claim_command): the bytes must be redis-py's own, for every argument,
    after a change of any of them, and with a pinned clock."""
    from siq_celery.backends.redis import RedisBackend
    from siq_celery.backends.redis_replies import _limit_args
    from siq_celery.types import Limits

    def expected(backend: RedisBackend, queue: str, now: object, epoch: str, limits: Limits) -> bytes:
        keys = backend.keys(queue).all
        sha = backend._script("claim").sha
        args = (now, 1, 5000, epoch, backend.idle_expiry_us(queue), *_limit_args(limits))
        return b"".join(conn.pack_command("EVALSHA", sha, len(keys), *keys, *args))

    client = redis.Redis.from_url(redis_url)
    conn = client.connection_pool.make_connection()  # only packs: never connected
    store = RedisBackend(client)
    for queue, limits in [("géo", Limits()), ("géo", Limits(2, 1000, 10_000_000, 3)), ("{t}:k", Limits(quota=5))]:
        for epoch in ("0123456789abcdef", "fedcba9876543210"):
            assert store._claim_command(queue, 1, 5000, epoch, limits) == expected(store, queue, "", epoch, limits)
        store.expire_when_idle(queue, 86_400_000_000)
        assert store._claim_command(queue, 1, 5000, "0" * 16, limits) == expected(store, queue, "", "0" * 16, limits)
    pinned = RedisBackend(client, clock=lambda: 1_700_000_000_000_000)
    got = pinned._claim_command("géo", 1, 5000, "0" * 16, Limits())
    assert got == expected(pinned, "géo", 1_700_000_000_000_000, "0" * 16, Limits())
    client.close()


def test_a_claim_after_the_server_closed_the_connection_reconnects(redis_url: str) -> None:
    """The thread's own connection, closed by the server (its idle ``timeout``, a proxy, a
    failover) between two publishes, is opened again before the claim, as the pool does:
    the publish keeps its ticket."""
    q = IntervalQueue("reopened", url=redis_url, interval="10ms")
    q.ensure()
    assert q.claim_later().ticket().number == 1
    admin = redis.Redis.from_url(redis_url)
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    assert q.claim_later().ticket().number == 2
    [own] = q.backend._spare  # type: ignore[attr-defined]
    q.close()
    assert own._sock is None  # closing the queue's store closes it too
    admin.close()


def test_a_forked_child_claims_on_a_connection_of_its_own(redis_url: str) -> None:
    """A prefork worker's child inherits its parent's claim connection: it must open its
    own (replies on a shared socket would reach the wrong process), and the parent's
    keeps working."""
    import multiprocessing

    q = IntervalQueue("forked", url=redis_url, interval="10ms")
    q.ensure()
    assert q.claim_later().ticket().number == 1
    [parent_conn] = q.backend._spare  # type: ignore[attr-defined]
    ctx = multiprocessing.get_context("fork")
    got = ctx.Queue()

    def child() -> None:
        numbers = [q.claim_later().ticket().number for _ in range(3)]
        got.put([*numbers, any(c is parent_conn for c in q.backend._spare)])  # type: ignore[attr-defined]

    procs = [ctx.Process(target=child) for _ in range(2)]
    for p in procs:
        p.start()
    numbers = [q.claim_later().ticket().number for _ in range(3)]
    results = [got.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(r[-1] is False for r in results)
    assert sorted(numbers + [n for r in results for n in r[:-1]]) == list(range(2, 11))
    assert q.backend._spare == [parent_conn]  # type: ignore[attr-defined]
    q.close()


@pytest.mark.parametrize(
    "reply",
    [
        # Redis 3.2 to 4.0, on a script that reads TIME and then writes
        "ERR Error running script (call to f_0123): @user_script:12: @user_script: 12: Write commands not allowed "
        "after non deterministic commands. Call redis.replicate_commands() at the start of your script in order "
        "to switch to single commands replication mode.",
        # Redis before 3.2 has no such mode at all
        "ERR Error running script (call to f_0123): @user_script:3: @user_script: 3: Unknown Redis command called "
        "from Lua script",
    ],
)  # fmt: skip
def test_a_redis_server_older_than_5_is_named_with_the_version_needed(reply: str) -> None:
    import redis

    from siq_celery.backends.redis import RedisBackend
    from siq_celery.errors import ConfigurationError

    error = RedisBackend._translate(redis.ResponseError(reply), "geo", "siq:{geo}:state")
    assert isinstance(error, ConfigurationError)
    assert "Redis 5.0 or newer" in str(error) and "'geo'" in str(error)
