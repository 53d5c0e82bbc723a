"""The private redis-servers of the demo and the tests: free ports that stay free, and a
start that knows its own server from another one on the same port."""

from __future__ import annotations

import socket

import pytest

from siq_celery import embedded
from siq_celery.embedded import EmbeddedRedis, free_cluster_port, free_port, server_pid
from siq_celery.errors import ConfigurationError


def test_free_ports_are_below_the_ephemeral_range_and_never_given_twice() -> None:
    # An outgoing connection takes its local port from the ephemeral range: a port picked
    # there can be gone by the time the server binds it.
    ephemeral = embedded._ephemeral_start()
    ports = [free_port() for _ in range(300)]
    cluster = [free_cluster_port() for _ in range(100)]
    assert len(set(ports + cluster)) == 400
    assert all(p < ephemeral for p in ports) and all(p + 10_000 < ephemeral for p in cluster)


def test_a_port_held_by_another_server_is_not_taken_for_the_new_one() -> None:
    with EmbeddedRedis() as first:
        assert server_pid(first.port) == first.pid
        # The old start took the first server's PONG for the second one's and went on.
        with pytest.raises(ConfigurationError, match="exited at start"):
            EmbeddedRedis(port=first.port).start()


def test_server_pid_of_a_port_nothing_listens_on_is_none() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert server_pid(s.getsockname()[1]) is None  # bound, not listening: refused
