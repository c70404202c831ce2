"""Benchmark: requests through ``pdfleet-runtime serve`` on the staged path, against the direct path and a torch copy.

    PYTHONPATH=runtime:operator:. python bench/gpu_serve.py --engine mooncake|nixl \\
        [--tokens 4096 32768 131072] [--reps 3] [--device cuda] [--out bench/results]

Three ``serve`` processes on one host (by default every rank on ``cuda:0``, the runtime config's
``placement``): one prefill pod and two decode pods, ``qwen3.8-flash-next`` tp 1 -> 1. The first decode
pod takes the staged path (``staging`` defaults: every request at or above the threshold), the second
has staging disabled (the direct write of the planner's scattered blocks). Requests are synthetic
(``POST /v1/synthetic``): the decode sends its indices at admission, the prefill allocates its items
(when both sides cut their staged plans and the decode receives its block table), fills seeded state
(the "compute"), then transfers. Every pod draws its pages at random (``--fault-scatter-pages``), as a
long-running pod's pools are: fresh pools hand out contiguous pages, which the planner would coalesce
into a few large blocks (both paths then move near the copy's speed, and the comparison says nothing). Chunk signals go through the engine (an 8-byte landed write per
chunk, a freed read when the ring is full), as between nodes; no shared memory.

GB/s = request bytes / (the prefill's state ready -> the decode knowing every byte is in place: the
last staged chunk scattered, or the direct write's status), both ``time.monotonic()`` of one host, read
from the pods' logs. Every byte is checked by the decode after that window (``mismatchedBytes``). Beside
them: a torch copy of the same number of bytes as one block on the same device (the ceiling of a
same-device transfer). The first request of each size and path is a warm-up. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LAYOUT = "qwen3.8-flash-next"
SECRET = b"gpu-serve-benchmark-secret-0123456789"
FAST = ("--fault-scatter-pages", "6", "--retry-period", "0.5", "--canary-timeout", "60", "--canary-tokens", "64", "--floor-gbps", "0.001",
        "--canary-period", "3600")


def _config(role: str, args: argparse.Namespace, staging: dict[str, Any]) -> Any:
    from pdfleet_runtime.config import RuntimeConfig, StagingConfig
    from pdfleet_runtime.layouts import LayoutRef
    from pdfleet_runtime.records import ParallelShape

    tokens = max(args.tokens)
    return RuntimeConfig(
        deployment="bench", namespace="default", role=role, runtime_version="0.1.0", layout=LayoutRef(preset=LAYOUT),
        shape=ParallelShape(1), peer_shape=ParallelShape(1), backend=args.engine, protocol=args.protocol,
        max_concurrent_requests=2, kv_tokens=int(tokens * 2.2), prefill_service="bench-prefill",
        secret_path=Path("/nonexistent"), device=args.device,
        placement=None if args.device == "cpu" else (args.gpu,), staging=StagingConfig(**staging))


def _times(log: str, pattern: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, log)}


def _peer_copy(nbytes: int, device: str, reps: int) -> dict[str, Any]:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        if src.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(src, dst))
    del src, dst
    med = statistics.median(times[1:])
    return {"median_s": med, "gbps": nbytes / med / 1e9, "byte_exact": ok}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdfleet_runtime.server.local import LocalPod

    work = Path(tempfile.mkdtemp(prefix="gpu-serve-"))
    staged_cfg = {"thresholdBytes": 0}
    if args.device == "cpu":
        staged_cfg |= {"onCpu": True, "slotMib": 16}
    pre = LocalPod(work, "pre", _config("prefill", args, staged_cfg), SECRET, args=("--fault-scatter-pages", "5"))
    env = {"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap}
    dec = {"staged": LocalPod(work, "dec-staged", _config("decode", args, staged_cfg), SECRET, args=FAST, env=env),
           "direct": LocalPod(work, "dec-direct", _config("decode", args, {"enabled": False}), SECRET, args=FAST,
                              env=env)}
    pods = [pre, *dec.values()]
    out: dict[str, Any] = {"sizes": [], "logs": str(work)}
    try:
        pre.start()
        for d in dec.values():
            d.start()
        for d in dec.values():
            d.wait_ready(True, 300)
        for tokens in args.tokens:
            size: dict[str, Any] = {"tokens": tokens, "paths": {}}
            for path, pod in dec.items():
                ids, bodies = [], []
                for rep in range(args.reps + 1):
                    rid = f"{path}-{tokens}-{rep}"
                    code, body = pod.synthetic(tokens, args.timeout, requestId=rid)
                    if code != 200 or not body.get("ok"):
                        raise RuntimeError(f"{rid}: HTTP {code}: {body}\n{pod.log()[-4000:]}")
                    if rep:
                        ids.append(rid)
                        bodies.append(body)
                ready = _times(pre.log(), r"request (\S+): filled \d+ tokens of seeded state; state ready at ([\d.]+)")
                landed = _times(pod.log(), r"request (\S+) <- \S+: success.*; (?:staged|direct), landed at ([\d.]+)")
                took = [landed[i] - ready[i] for i in ids]
                nbytes = int(bodies[0]["bytes"])
                med = statistics.median(took)
                kinds = {k for i, k in re.findall(r"request (\S+) <- \S+: success.*; (staged|direct), landed at", pod.log())
                         if i in ids}
                if kinds != {path}:
                    raise RuntimeError(f"{path} decode pod moved {ids} by {sorted(kinds)}")
                size["bytes"] = nbytes
                size["paths"][path] = {"seconds": took, "median_s": med, "gbps": nbytes / med / 1e9,
                                       "engine_write_s": [float(b["writeSeconds"]) for b in bodies],
                                       "request_s": [float(b["seconds"]) for b in bodies],
                                       "mismatched_bytes": sum(int(b["mismatchedBytes"]) for b in bodies),
                                       "paths_seen": sorted(kinds)}
                print(f"  {tokens:>7} tokens {path:7s} {nbytes / med / 1e9:8.1f} GB/s  median {med * 1e3:8.3f} ms  "
                      f"mismatched {size['paths'][path]['mismatched_bytes']}  (engine write s "
                      f"{size['paths'][path]['engine_write_s']}, request s {size['paths'][path]['request_s']})",
                      flush=True)
            size["peer_copy"] = _peer_copy(size["bytes"], "cpu" if args.device == "cpu" else f"cuda:{args.gpu}",
                                           args.reps)
            p = size["paths"]
            size["staged_over_direct"] = p["staged"]["gbps"] / p["direct"]["gbps"]
            size["staged_over_copy"] = p["staged"]["gbps"] / size["peer_copy"]["gbps"]
            print(f"  {tokens:>7} tokens copy    {size['peer_copy']['gbps']:8.1f} GB/s; staged/direct "
                  f"{size['staged_over_direct']:.1f}x, staged/copy {size['staged_over_copy']:.3f}", flush=True)
            out["sizes"].append(size)
        out["staged_metrics"] = _staged_stats(pre.log())
    finally:
        for p in pods:
            p.stop()
            (args.out / f"serve-{args.engine}-{p.name}.log").write_text(p.log()[-(4 << 20):])
    return out


def _staged_stats(log: str) -> list[str]:
    """The prefill's per-request staged lines (chunk and signal costs), as logged."""
    return re.findall(r"staged leg .*", log)[-12:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=("mooncake", "nixl"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu", type=int, default=0, help="the one GPU every rank is placed on")
    parser.add_argument("--protocol", default=None, help="default nvlink on cuda, tcp on cpu")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    args.protocol = args.protocol or ("nvlink" if args.device == "cuda" else "tcp")
    print(f"{LAYOUT} tp1 -> tp1 through serve, {args.engine} {args.protocol}, "
          f"{'cpu' if args.device == 'cpu' else f'all ranks on cuda:{args.gpu}'}, median of {args.reps} (+1 warm-up)",
          flush=True)
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    ok = all(p["mismatched_bytes"] == 0 for s in res["sizes"] for p in s["paths"].values())
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report = {"benchmark": "gpu_serve", "engine": args.engine, "protocol": args.protocol, "layout": LAYOUT,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": stamp, "seconds": time.time() - t0, "byte_exact": ok,
              "machine": {"host": platform.node(), "python": platform.python_version(), "device": args.device},
              "reps": args.reps, "results": res}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-serve-{args.engine}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\n{'engine':9} {'tokens':>7} {'MB':>7} {'staged':>8} {'direct':>8} {'copy':>8} {'st/dir':>7} {'st/copy':>7}")
    for s in res["sizes"]:
        p = s["paths"]
        print(f"{args.engine:9} {s['tokens']:>7} {s['bytes'] / 1e6:>7.0f} {p['staged']['gbps']:>8.1f} "
              f"{p['direct']['gbps']:>8.1f} {s['peer_copy']['gbps']:>8.1f} {s['staged_over_direct']:>7.1f} "
              f"{s['staged_over_copy']:>7.3f}")
    print(f"byte-exact: {ok}; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
