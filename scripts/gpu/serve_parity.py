"""GPU parity through ``pdfleet-runtime serve``: real pod processes on one host, every rank placed on one GPU.

    PYTHONPATH=runtime:operator:. python scripts/gpu/serve_parity.py --engine mooncake|nixl [--device cuda]

Per case (layout, prefill tp -> decode tp): one prefill pod and one decode pod (``placement``: every
rank on ``--gpu``), synthetic requests staged (above the threshold) and direct (below it); the decode
checks every byte of every request against the seeded state (``mismatchedBytes``) and the log names the
path each took. Mooncake: ``qwen3.8-flash-next`` 1 -> 1 and 2 -> 1; NIXL: ``qwen3.8-flash-next`` 1 -> 1
and ``qwen3-next-hybrid`` 2 -> 1 (the matrix denies NIXL moving PLE state across TP sizes). JSON lines
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SECRET = b"gpu-serve-parity-secret-0123456789ab"
FAST = ("--retry-period", "0.5", "--canary-timeout", "60", "--canary-tokens", "64", "--floor-gbps", "0.001",
        "--canary-period", "3600")
CASES = {"mooncake": [("qwen3.8-flash-next", 1, 1), ("qwen3.8-flash-next", 2, 1)],
         "nixl": [("qwen3.8-flash-next", 1, 1), ("qwen3-next-hybrid", 2, 1)]}
SIZES = (4096, 1024, 16)
THRESHOLD_BYTES = 96 << 20
"""Staged at or above (qwen3.8-flash-next: 16 tokens carry 79 MB of recurrent and PLE state, 4,096 tokens 191 MB)."""


def _config(role: str, layout: str, tp: int, peer_tp: int, args: argparse.Namespace) -> Any:
    from pdfleet_runtime.config import RuntimeConfig, StagingConfig
    from pdfleet_runtime.layouts import LayoutRef
    from pdfleet_runtime.records import ParallelShape

    staging = StagingConfig(threshold_bytes=THRESHOLD_BYTES, on_cpu=args.device == "cpu",
                            slot_mib=16 if args.device == "cpu" else 256)
    return RuntimeConfig(
        deployment="parity", namespace="default", role=role, runtime_version="0.1.0", layout=LayoutRef(preset=layout),
        shape=ParallelShape(tp), peer_shape=ParallelShape(peer_tp), backend=args.engine, protocol=args.protocol,
        max_concurrent_requests=2, kv_tokens=8192, prefill_service="parity-prefill", secret_path=Path("/nonexistent"),
        device=args.device, placement=None if args.device == "cpu" else (args.gpu,) * tp, staging=staging)


def case(layout: str, ptp: int, dtp: int, args: argparse.Namespace) -> dict[str, Any]:
    from pdfleet_runtime.testing.local import LocalPod

    work = Path(tempfile.mkdtemp(prefix="serve-parity-"))
    pre = LocalPod(work, "pre", _config("prefill", layout, ptp, dtp, args), SECRET)
    dec = LocalPod(work, "dec", _config("decode", layout, dtp, ptp, args), SECRET, args=FAST,
                   env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    out: dict[str, Any] = {"layout": layout, "prefill_tp": ptp, "decode_tp": dtp, "engine": args.engine,
                           "requests": []}
    t0 = time.time()
    try:
        pre.start()
        dec.start()
        dec.wait_ready(True, 300)
        for i, tokens in enumerate(SIZES * 2):
            rid = f"r{i}-{tokens}"
            code, body = dec.synthetic(tokens, 120, requestId=rid)
            m = re.search(rf"request {rid} <- \S+: success.*; (staged|direct), landed at", dec.log())
            out["requests"].append({"id": rid, "tokens": tokens, "http": code, "ok": bool(body.get("ok")),
                                    "bytes": body.get("bytes"), "mismatched_bytes": body.get("mismatchedBytes"),
                                    "path": m.group(1) if m else None,
                                    "want": "staged" if (body.get("bytes") or 0) >= THRESHOLD_BYTES * dtp else "direct"})
        out["staged_legs"] = re.findall(r"staged leg .*", pre.log())[-4:]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["log_tail"] = {"pre": pre.log()[-3000:], "dec": dec.log()[-3000:]}
    finally:
        pre.stop()
        dec.stop()
    reqs = out["requests"]
    out["paths"] = sorted({r["path"] for r in reqs if r["path"]})
    out["passed"] = bool(reqs) and "error" not in out and out["paths"] == ["direct", "staged"] and all(
        r["ok"] and r["mismatched_bytes"] == 0 and r["path"] == r["want"] for r in reqs)
    out["seconds"] = time.time() - t0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=("mooncake", "nixl"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--protocol", default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    args.protocol = args.protocol or ("nvlink" if args.device == "cuda" else "tcp")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-serve-parity-{args.engine}.jsonl"
    ok = True
    with path.open("a") as f:
        for layout, ptp, dtp in CASES[args.engine]:
            res = case(layout, ptp, dtp, args)
            f.write(json.dumps(res) + "\n")
            ok &= res["passed"]
            paths = [f"{r['tokens']}:{r['path']}:{r['mismatched_bytes']}" for r in res["requests"]]
            print(f"serve parity {args.engine} {layout} tp{ptp} -> tp{dtp}: {'PASS' if res['passed'] else 'FAIL'} "
                  f"({res['seconds']:.0f}s) tokens:path:mismatched {' '.join(paths)}", flush=True)
            for line in res.get("staged_legs", []):
                print(f"    {line}")
            if "error" in res:
                print(res["error"], res["log_tail"]["pre"][-1500:], res["log_tail"]["dec"][-1500:], sep="\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
