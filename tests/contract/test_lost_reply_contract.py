"""A script whose reply was lost may have run: redis-py must not send it again.

siq_celery turns redis-py's own retries off (``client_defaults``) and retries in its own
loops, which know what each operation means: a claim re-sent blindly after its reply was
lost claims a second ticket that nobody holds, and the line waits an interval for it.
On Redis Cluster the cluster client has a retry loop of its own around every command
(``cluster_error_retry_attempts``, 3, before redis-py 6.0; ruled by ``retry`` since): it
re-sends a command after a ConnectionError or a TimeoutError, as when the master of the
slot dies or hangs with the reply unread. Here the server runs the claim and the client
loses the reply (a TimeoutError raised after the reply was read off the socket).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from siq_celery import StoreUnavailableError
from siq_celery.testing import PinnedClock
from tests.conftest import Store

I = 100_000


@pytest.fixture(params=["redis", pytest.param("redis-cluster", marks=pytest.mark.cluster)])
def redis_store(request: pytest.FixtureRequest, clock: PinnedClock) -> Store:
    kind = request.param
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster")
    return Store(kind, url if isinstance(url, str) else url.url, clock, "lost")


@pytest.fixture
def lose_next_evalsha_reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Arm with ``armed["left"] = 1``: the next EVALSHA runs on the server, its reply is
    read and dropped, and the client sees a TimeoutError. ``armed["sent"]`` counts EVALSHAs."""
    armed = {"left": 0, "sent": 0}
    parse = redis.Redis.parse_response

    def parse_response(self: redis.Redis, connection: Any, command_name: Any, **options: Any) -> Any:
        reply = parse(self, connection, command_name, **options)
        if str(command_name).upper() == "EVALSHA":
            armed["sent"] += 1
            if armed["left"]:
                armed["left"] -= 1
                raise redis.TimeoutError("the reply was lost (test)")
        return reply

    monkeypatch.setattr(redis.Redis, "parse_response", parse_response)
    yield armed


def test_a_claim_whose_reply_was_lost_is_not_sent_again(redis_store: Store, lose_next_evalsha_reply: dict) -> None:
    backend = redis_store.backend()
    state, _ = backend.ensure("q", I, "e1")
    assert backend.claim("q", 1, I, state.epoch).first == 1
    lose_next_evalsha_reply.update(left=1, sent=0)
    with pytest.raises(StoreUnavailableError):
        backend.claim("q", 1, I, state.epoch)
    assert lose_next_evalsha_reply["sent"] == 1, "the claim was sent once"
    status = backend.status("q")
    assert status is not None and status.state.ticket == 2, "the lost claim took one ticket, and only one"
    assert backend.claim("q", 1, I, state.epoch).first == 3, "the next claim goes on from there"
