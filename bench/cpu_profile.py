"""Where the worker processes' CPU goes: the folded stacks ``SIQ_BENCH_PROFILE=DIR`` has
py-spy write for each run of ``bench/peers.py``, summed over the files given.

    SIQ_BENCH_PROFILE=/tmp/prof python bench/peers.py --scenarios spacing --intervals 5 \\
        --profiles empty --limiters siq,none --runs 1
    python bench/cpu_profile.py /tmp/prof/siq-5ms-*.txt [--top 40] [--tasks 400]

Prints each function's share of the samples including what it calls (a function counted
once a stack), then its own; with ``--tasks`` the milliseconds a task that share stands for
(py-spy samples at 500 Hz: 2 ms a sample).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
SAMPLE_MS = 2.0  # 500 Hz


def frames(stack: str) -> list[str]:
    """``func (path:line)`` frames as ``func (short path)``, the process frames left out."""
    out = []
    for frame in stack.split(";"):
        m = FRAME.match(frame.strip())
        if not m:
            continue
        path = m["file"]
        for marker in ("site-packages/", "siq_celery/", "bench/", "lib/python3"):
            if marker in path:
                path = path[path.index(marker) :]
                break
        out.append(f"{m['func']} ({path})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--tasks", type=int, default=0, help="tasks the runs started: ms a task")
    args = parser.parse_args()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for path in args.files:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            fs = frames(stack)
            for f in set(fs):
                inclusive[f] += n
            if fs:
                own[fs[-1]] += n
    scale = SAMPLE_MS / args.tasks if args.tasks else 0.0
    per_task = f", {total * scale:.2f} ms a task" if scale else ""
    print(f"{total} samples ({total * SAMPLE_MS / 1e3:.2f} s of CPU){per_task}")
    for title, table in (("including callees", inclusive), ("own", own)):
        print(f"\n## {title}")
        for f, n in table.most_common(args.top):
            extra = f"  {n * scale:6.3f} ms" if scale else ""
            print(f"{100 * n / total:5.1f}%{extra}  {f}")


if __name__ == "__main__":
    main()
