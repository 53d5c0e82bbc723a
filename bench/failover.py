"""Failover acceptance runner (issue 27): nothing runs twice, and no start comes closer
than the interval, across a failover of the state store behind Redis Sentinel or on Redis
Cluster.

    make bench-failover                                   # every fault, 50 ms x 240 and 5 s x 10
    python bench/failover.py --fault kill --interval 50ms --tasks 240 --runs 3
    python bench/failover.py --fault partition,lag --interval 5s --tasks 10 --runs 1
    python bench/failover.py --store cluster --fault kill --interval 50ms --tasks 240 --runs 3

Each run builds the setup of the issue from scratch: a Celery broker on its own Redis;
the state store on a master, one replica (``--data-replicas``) and three sentinels (``mymaster``, quorum 2,
``down-after-milliseconds`` 1000, ``failover-timeout`` 5000), reached as
``redis+sentinel://.../mymaster/0`` (``--store cluster``: a Redis Cluster of three masters
with one replica each, ``cluster-node-timeout`` 1000, reached as
``redis+cluster://`` every node); 3 worker nodes x ``-c 2`` (tests/apps/geo.py, task
``geo.record``); a broker visibility timeout of 8 s (``siq_horizon`` 6 s, below it, as the
settings' docs ask). Bodies record each start (task id, host clock) in a third Redis,
not the one failed over. Once a third of the tasks started, one fault hits the store:

* ``kill``: SIGKILL of the master (on Cluster, of the master of the queue's hash slot; the
  only fault there).
* ``partition``: the master SIGSTOPped for 6 s (``--stop``), then SIGCONT: it comes back a
  writable master, with its clients, until Sentinel makes it a replica.
* ``lag``: the replica SIGSTOPped and its link cut (``CLIENT KILL TYPE replica``) for 3 s
  (``--lag``), then the master SIGKILLed and the replica resumed: Sentinel promotes a
  replica that missed the master's last writes. With an interval longer than the lag, the
  lag starts so that the next slot falls in the middle of it (a start and a finish lost).

One line per run: tasks completed, tasks whose body started twice (same task id), the
smallest gap between body starts and how many gaps are below 0.9 x the interval, the
stall (largest gap between consecutive body starts from the fault on) and the promotion
time (fault to a sentinel reporting the new master; on Cluster, to every live node naming
the slot's replica its master). Then a Markdown table. After the last
task finishes the runner waits the visibility timeout and a few seconds more, so a copy
the broker hands back shows. Double runs and close gaps are printed with their records;
the logs of every run (workers, servers, sentinels) and its records (records.json) stay
in ``--logdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from siq_celery.intervals import parse_duration  # noqa: E402
from tests.failover.conftest import (  # noqa: E402
    VISIBILITY_TIMEOUT_S,
    ClusterSet,
    Figures,
    HarnessError,
    SentinelSet,
    failover_env,
    measure,
)
from tests.faults.conftest import ControlledRedis, publish  # noqa: E402
from tests.integration.conftest import CeleryRun  # noqa: E402

FAULTS = ("kill", "partition", "lag")
STORES = ("sentinel", "cluster")
#: The faults each store's harness injects (Cluster: the slot's master killed).
STORE_FAULTS = {"sentinel": FAULTS, "cluster": ("kill",)}
#: The siq queue of the app's geo.record, whose hash slot the Cluster fault hits.
QUEUE = "geo"


def inject(
    fault: str, sset: SentinelSet | ClusterSet, run: CeleryRun, interval_s: float, args: argparse.Namespace
) -> dict[str, float]:
    """Hit the store with ``fault``; the moment of the fault, the promotion time and (partition) the demotion time."""
    if isinstance(sset, ClusterSet):
        assert fault == "kill", "Cluster: only the slot's master killed"
        at = sset.kill_slot_master(QUEUE)
        return {"at": at, "promotion": sset.wait_promotion(30)}
    if fault == "kill":
        at = sset.kill_master()
        return {"at": at, "promotion": sset.wait_promotion(30)}
    if fault == "partition":
        at = sset.stop_master()
        promotion = sset.wait_promotion(30)
        time.sleep(max(0.0, at + args.stop - time.time()))
        sset.cont_master()
        return {"at": at, "promotion": promotion, "demoted": args.stop + sset.wait_demoted(40)}
    # lag: with a long interval, the next slot falls in the middle of the lag
    if interval_s > args.lag:
        last = max(s["t"] for s in run.starts())
        time.sleep(max(0.0, last + interval_s - args.lag / 2 - time.time()))
    at = sset.lag_replica(args.lag)
    return {"at": at, "promotion": sset.wait_promotion(30)}


#: A pool process's log line with the store's answer to a start: "geo.record[id]: wait; ticket 81 of
#: 'geo' deferred 0.980s", "...: ticket 90 of 'geo' parked, 12s from its slot"; and one that the
#: store did not answer.
_STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/ForkPoolWorker-\d+\] "
_ANSWER = re.compile(_STAMP + r".*[:;] ticket \d+ of .* (deferred|parked)")
_UNANSWERED = re.compile(_STAMP + r".*state store unreachable")


def first_answer(run: CeleryRun, fault_at: float) -> float:
    """Seconds from the fault until a worker first had an answer from the store after its
    first unanswered start: a start, or a deferral or parking logged (Celery's log times,
    local, ms). NaN: no start went unanswered (a fault between two starts)."""

    def stamps(pattern: re.Pattern[str]) -> list[float]:
        out = []
        for w in run.workers:
            for line in w.log().splitlines():
                if m := pattern.match(line):
                    out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
        return out

    failed = [t for t in stamps(_UNANSWERED) if t > fault_at]
    if not failed:
        return float("nan")
    times = [s["t"] for s in run.starts() if s["t"] > min(failed)] + [t for t in stamps(_ANSWER) if t > min(failed)]
    return min(times, default=float("nan")) - fault_at


def wait_done(run: CeleryRun, tasks: int, timeout: float, settle: float) -> None:
    """Until every task finished (or ``timeout`` s), then ``settle`` s more for copies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len({f["n"] for f in run.finishes()}) < tasks:
        time.sleep(0.25)
    time.sleep(settle)


def describe(run: CeleryRun, figures: Figures, fault_at: float) -> list[str]:
    """The records of every double run and close gap, and the worker log lines of those tasks."""
    lines: list[str] = []

    def row(s: dict[str, Any]) -> str:
        return (f"    n={s['n']} id={s['task_id'][:8]} t={s['t'] - fault_at:+.3f}s ticket={s['ticket']} "
                f"store_start_us={s['store_start_us']} node={s['node']} pid={s['pid']} "
                f"retries={s['retries']}")  # fmt: skip

    starts = run.starts()
    for n in figures.ran_twice:
        lines.append(f"  ran twice: task {n}")
        ids = {s["task_id"] for s in starts if s["n"] == n}
        lines += [row(s) for s in starts if s["n"] == n]
        for w in run.workers:
            lines += [f"    {w.name}: {ln.strip()}" for ln in w.log().splitlines() if any(i in ln for i in ids)]
    for a, b in figures.close_pairs[:10]:
        both = a["store_start_us"] and b["store_start_us"]
        on_store = (f"{(b['store_start_us'] - a['store_start_us']) / 1000:.1f} ms apart on the store's clock"
                    if both else "no store times")  # fmt: skip
        lines.append(f"  close gap {(b['t'] - a['t']) * 1000:.1f} ms on the bodies' host clock, {on_store}:")
        lines += [row(a), row(b)]
    return lines


def one_run(
    fault: str, interval: str, tasks: int, logdir: Path, args: argparse.Namespace
) -> tuple[Figures, dict[str, float]]:
    interval_s = parse_duration(interval) / 1e6
    with contextlib.ExitStack() as stack:
        sset: SentinelSet | ClusterSet = stack.enter_context(
            ClusterSet() if args.store == "cluster" else SentinelSet(replicas=args.data_replicas)
        )
        broker = stack.enter_context(ControlledRedis(persistent=True))
        records = stack.enter_context(ControlledRedis())
        env = failover_env(sset.url, broker, records, interval)
        if args.replicas:
            env["SIQ_TEST_STORE_REPLICAS"] = str(args.replicas)
        run = CeleryRun(env, logdir)
        stack.callback(lambda: shutil.copytree(sset.tmp.name, logdir / "servers", dirs_exist_ok=True))
        stack.callback(run.close)
        run.start_workers(args.nodes, args.concurrency)
        publish(run, range(tasks), **({"work": args.work} if args.work else {}))
        run.wait_for(lambda s: len(s) >= max(2, tasks // 3), 60 + tasks * interval_s, "a third of the tasks")
        times = inject(fault, sset, run, interval_s, args)
        wait_done(run, tasks, args.timeout or 60 + 2 * tasks * interval_s, VISIBILITY_TIMEOUT_S + 4)
        starts, finishes = run.starts(), run.finishes()
        (logdir / "records.json").write_text(json.dumps({"times": times, "starts": starts, "finishes": finishes}))
        figures = measure(starts, finishes, tasks, interval_s * 1000, times["at"], times["promotion"])
        times["answer"] = first_answer(run, times["at"])
        if figures.ran_twice or figures.close_pairs or figures.completed < tasks:
            detail = "\n".join(describe(run, figures, times["at"]))
            (logdir / "diagnosis.txt").write_text(detail + "\n")
            print(detail)
        return figures, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="sentinel", choices=STORES, help="where the state store fails over")
    parser.add_argument("--fault", default="kill,partition,lag", help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--interval", default="50ms", help="the task's interval: 50ms, 5s")
    parser.add_argument("--tasks", type=int, default=240)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--stop", type=float, default=6.0, help="partition: seconds the master stays stopped")
    parser.add_argument("--lag", type=float, default=3.0, help="lag: seconds the replica misses the master's writes")
    parser.add_argument("--work", type=float, default=0.0, help="seconds each body takes (default: none)")
    parser.add_argument("--replicas", type=int, default=0, help="siq_store_replicas of the workers (default: 0)")
    parser.add_argument("--data-replicas", type=int, default=1, help="replicas the master has (default: 1)")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for every task (0: from the run)")
    parser.add_argument("--logdir", default="", help="where each run's logs stay (default: a new temp dir)")
    args = parser.parse_args()
    faults = [f for f in args.fault.split(",") if f]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown fault(s) {sorted(unknown)}: choose from {', '.join(FAULTS)}")
    if unsupported := [f for f in faults if f not in STORE_FAULTS[args.store]]:
        sys.exit(f"failover.py: --store {args.store} injects only --fault {','.join(STORE_FAULTS[args.store])}, "
                 f"not {','.join(unsupported)}")  # fmt: skip
    if args.store == "cluster" and args.data_replicas != 1:
        sys.exit("failover.py: --store cluster has one replica per master; --data-replicas is for sentinel")
    if args.store == "cluster" and args.replicas:
        sys.exit("failover.py: --store cluster: siq_store_replicas is not used on Redis Cluster (docs/design.md)")
    logroot = Path(args.logdir or tempfile.mkdtemp(prefix="siq-failover-"))
    print(f"# failover ({args.store}): {args.nodes} nodes x -c {args.concurrency}, interval {args.interval}, "
          f"{args.tasks} tasks (bodies {args.work:g} s); {args.data_replicas} replica(s) per master, "
          f"siq_store_replicas {args.replicas}; "
          f"{platform.python_version()}, {platform.machine()}; logs in {logroot}")  # fmt: skip
    rows = []
    for fault in faults:
        for n in range(1, args.runs + 1):
            logdir = logroot / f"{args.store}-{fault}-{args.interval}-{n}"
            try:
                figures, times = one_run(fault, args.interval, args.tasks, logdir, args)
            except HarnessError as exc:
                print(f"{args.store} {fault} run {n}: harness failed: {exc}")
                continue
            extra = f", first answer after {times['answer']:.2f} s"
            extra += f", demoted after {times['demoted']:.1f} s" if "demoted" in times else ""
            print(f"{args.store} {fault} run {n}: {figures.line()}{extra}", flush=True)
            rows.append((fault, n, figures, times["answer"]))
    print("\n| store | fault | interval | run | completed | ran twice | smallest body gap | gaps < 0.9 I | stall "
          "| promotion | first answer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for fault, n, f, answer in rows:
        print(f"| {args.store} | {fault} | {args.interval} | {n} | {f.completed}/{f.tasks} | {len(f.ran_twice)} | "
              f"{f.smallest_gap_ms:.1f} ms | {f.below_cap} | {f.stall_s:.2f} s | {f.promotion_s:.2f} s "
              f"| {answer:.2f} s |")  # fmt: skip


if __name__ == "__main__":
    main()
