"""Benchmark: how long a pod's rank processes take to start, from the fork server against a spawn per rank.

    PYTHONPATH=runtime:operator python bench/rank_start.py [--rounds 5] [--tp 1 4] [--backend mooncake]
        [--layout qwen3-next-hybrid] [--out bench/results]

Each trial is a fresh Python process, as a pod is: it starts one decode pod's ranks (``RankLauncher``, the
layout's pools and the backend's engine on loopback, as ``pdfleet-runtime parity`` does) and times
``start`` until every rank said ready, then stops them. ``forkserver`` is what pods run (the server imports
torch and the rank module once, then forks each rank); ``spawn`` is the baseline, what pods ran before (a
fresh interpreter per rank, each importing torch). The two alternate within each round, so host noise (a
shared 2-core host) hits both alike; the ratio is the median over rounds of spawn / forkserver per round.
Prints medians and ratios per TP size; writes JSON to ``--out``. No target: the figure says what a TP-N pod
saves at start (CPU on a crowded node, wall time where cores are short).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

METHODS = ("spawn", "forkserver")


def _trial(layout: str, tp: int, backend: str, method: str) -> dict[str, float]:
    """In the child: one decode pod's ranks started and stopped; seconds to ready and in all."""
    from pdfleet_runtime.pod.launcher import RankLauncher
    from pdfleet_runtime.records import ParallelShape
    from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
    from pdfleet_runtime.verify.group import CasePods

    spec = GroupSpec(backend, ParallelShape(1), ParallelShape(tp), (CaseSpec(layout),))
    pods = CasePods(spec, spec.cases[0])

    async def main() -> dict[str, float]:
        launcher = RankLauncher(pods.decode.specs, start_method=method)  # type: ignore[arg-type]
        t0 = time.monotonic()
        await launcher.start(300.0)
        ready = time.monotonic() - t0
        await launcher.stop(10.0)
        return {"ready_s": ready, "total_s": time.monotonic() - t0}

    return asyncio.run(main())


def _run_trial(layout: str, tp: int, backend: str, method: str) -> dict[str, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, __file__, "--child", layout, str(tp), backend, method],
                         capture_output=True, text=True, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.monotonic() - t0  # the interpreter's own start and imports included
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    p.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"))
    p.add_argument("--layout", default="qwen3-next-hybrid")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        layout, tp, backend, method = args.child
        print(json.dumps(_trial(layout, int(tp), backend, method)))
        return 0

    report: dict[str, Any] = {"bench": "rank_start", "layout": args.layout, "backend": args.backend,
                              "rounds": args.rounds, "host": platform.node(), "cpus": _cpus(), "by_tp": {}}
    for tp in args.tp:
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            rounds.append({m: _run_trial(args.layout, tp, args.backend, m) for m in order})
            print(f"tp{tp} round {r + 1}: " + ", ".join(f"{m} ready {rounds[-1][m]['ready_s']:.2f}s" for m in METHODS),
                  flush=True)
        row: dict[str, Any] = {}
        for m in METHODS:
            for k in ("ready_s", "process_s"):
                row[f"{m}_{k}_median"] = round(statistics.median(x[m][k] for x in rounds), 3)
        for k in ("ready_s", "process_s"):
            row[f"{k}_spawn_over_forkserver"] = round(statistics.median(
                x["spawn"][k] / x["forkserver"][k] for x in rounds), 3)
        row["rounds"] = rounds
        report["by_tp"][str(tp)] = row
        print(f"tp{tp}: ranks ready in {row['forkserver_ready_s_median']:.2f}s (fork server) vs "
              f"{row['spawn_ready_s_median']:.2f}s (spawn): spawn/forkserver {row['ready_s_spawn_over_forkserver']:.2f}x; "
              f"whole pod process {row['process_s_spawn_over_forkserver']:.2f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank-start-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
