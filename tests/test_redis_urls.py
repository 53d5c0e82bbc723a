"""Every Redis URL form reaches a real server: Unix socket, ACL user/password, Sentinel.

(Cluster is covered by the contract suite; TLS has its own test with a TLS server.)
"""

from __future__ import annotations

import inspect
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from siq_celery import ConfigurationError, IntervalQueue, StoreUnavailableError
from siq_celery.backends.redis import ACL_RULES
from siq_celery.embedded import EmbeddedRedis, free_port, redis_server_binary


def exercise(url: str) -> None:
    q = IntervalQueue("urls", url=url, interval="10ms")
    q.ensure(reset=True)
    with q.slot() as decision:
        assert decision.authorized
    assert q.status().state.current == 1
    q.delete()


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


def test_the_readme_acl_is_the_one_the_code_needs() -> None:
    from pathlib import Path

    from siq_celery.backends.redis import ACL_RULES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"ACL SETUSER siq on >PASSWORD {' '.join(ACL_RULES)}\n" in readme


def test_a_publish_claims_with_the_pool_of_redis_py_5_0_to_5_2(redis_url: str) -> None:
    """redis-py 5.0 to 5.2 require the command name in ``get_connection``: the claim sent
    ahead of a publish must still get its connection there."""
    q = IntervalQueue("old-pool", url=redis_url, interval="10ms")
    q.ensure()
    first = q.claim()  # scripts loaded with the pool as it is
    pool = q.backend.client.connection_pool  # type: ignore[attr-defined]
    real = pool.get_connection
    name = inspect.signature(real).parameters.get("command_name")
    takes_name = name is not None and name.default is inspect.Parameter.empty  # redis-py 5.0-5.2 itself
    asked: list[str] = []

    def get_connection(command_name: str, *keys: object, **options: object) -> object:
        asked.append(command_name)
        return real(command_name) if takes_name else real()

    pool.get_connection = get_connection  # the 5.0-5.2 signature: no default
    try:
        pending = q.backend.claim_later(q.name, 1, q.interval_us, first.epoch)
    finally:
        del pool.get_connection
    assert asked == ["EVALSHA"]
    assert pending.result().first == first.number + 1


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
