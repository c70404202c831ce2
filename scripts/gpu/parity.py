"""GPU parity: every rank its own process on the host's GPUs, through the real engine over ``nvlink``.

    python3 scripts/gpu/parity.py --backend mooncake|nixl [--ucx-tls VALUE] [--tokens 4096] [--requests 4]

Shapes (``qwen3.8-flash-next``): prefill tp 1 -> decode tp 1 (GPU0 -> GPU1), tp 2 -> tp 2 (every leg
crosses GPUs) and tp 2 -> tp 1 (prefill ranks on GPU0 and GPU1, decode on GPU1: one leg within a
GPU, one across); every rank is a serving rank process (``rank.process``), placed by
``verify.cases.gpu_of``. A shape the capability matrix rejects is reported with its reason and
run with ``FALLBACK`` instead. Each decode rank compares its whole arena (background plus every
request's seeded state at its items) byte for byte. Prints one JSON
line per shape; exit 1 on any mismatch or failure. Same flow as ``pdfleet-runtime parity --device
cuda``, which cannot override the protocol table's ``UCX_TLS`` (the probe may have to).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
from pdfleet_runtime.verify.group import run_group

SHAPES = (("tp=1", "tp=1"), ("tp=2", "tp=2"), ("tp=2", "tp=1"))
LAYOUT = "qwen3.8-flash-next"
FALLBACK = "qwen3-next-hybrid"
"""Where the capability matrix rejects a shape for ``LAYOUT`` (NIXL: replicated PLE state across TP 2 -> 1),
the rejection is printed and the shape runs with this layout (no PLE, no QSA) instead."""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True, choices=("mooncake", "nixl"))
    ap.add_argument("--ucx-tls", default="table")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    env: dict[str, str | None] = {} if args.ucx_tls == "table" else {"UCX_TLS": args.ucx_tls}
    ok = True
    todo = [(p, d, LAYOUT) for p, d in SHAPES]
    while todo:
        p, d, layout = todo.pop(0)
        spec = GroupSpec(args.backend, ParallelShape.parse(p), ParallelShape.parse(d),
                         (CaseSpec(layout, args.requests, args.tokens, 7),),
                         device=args.device, protocol=LinkProtocol.NVLINK if args.device == "cuda" else LinkProtocol.TCP,
                         engine_env=env)
        t0 = time.perf_counter()
        r = run_group(spec)[0]
        line = {"backend": args.backend, "layout": layout, "prefill": p, "decode": d, "ok": r.ok, "bytes_moved": r.bytes_moved,
                "descriptors": r.descriptors, "mismatched_bytes": r.mismatched_bytes,
                "first_mismatch": r.first_mismatch.describe() if r.first_mismatch else None,
                "rejected": r.rejection.reason if r.rejection else None, "request_tokens": r.request_tokens,
                "devices": r.details.devices if r.details else None, "transfer_seconds": round(r.copy_seconds, 4),
                "ucx_tls": args.ucx_tls, "wall_seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(line), flush=True)
        if r.rejection is not None and layout == LAYOUT:  # the matrix's verdict, not a failure
            todo.append((p, d, FALLBACK))
            continue
        ok &= r.ok
    print(f"PARITY {'OK' if ok else 'FAILED'} ({args.backend})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
