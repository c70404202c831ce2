"""Benchmark: synthetic requests through two ``pdfleet-runtime serve`` processes, against the engine adapter.

    PYTHONPATH=runtime:operator python bench/serve.py [--tokens 4096] [--requests 8] [--concurrency 1 2]

A prefill pod and a decode pod (``qwen3.8-flash-next``, tp 1 each, Mooncake over TCP on 127.0.0.1,
cpu pools) are started as local processes, exactly as ``serve`` runs in a pod. Once the decode is
ready (its canary verified), ``--requests`` synthetic requests of ``--tokens`` tokens are sent to
its ``/v1/synthetic`` per concurrency level: the prefill fills seeded state, the engine writes it,
the decode verifies every byte. Reported per level: requests per second, client latency (p50, p95),
the engine write time and throughput the prefill measured, and the same without the decode's byte
check (``verify: false``). In the same run, ``bench/engines.py``'s adapter measurement (Mooncake tcp,
the same layout and token count) gives the engine's own throughput for the same bytes, so the
server's overhead shows as the ratio. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.testing.local import LocalPod

LAYOUT = "qwen3.8-flash-next"
SECRET = b"bench-serve-secret-0123456789abcdef"


def _config(role: str, tokens: int, slots: int) -> RuntimeConfig:
    return RuntimeConfig(deployment="bench", namespace="default", role=role, runtime_version="0.1.0",
                         layout=LayoutRef(preset=LAYOUT), shape=ParallelShape(1), peer_shape=ParallelShape(1),
                         backend="mooncake", protocol="tcp", max_concurrent_requests=slots,
                         kv_tokens=tokens * slots, prefill_service="bench-prefill", secret_path=Path("/unused"),
                         drain_timeout_seconds=60, device="cpu")


def _level(dec: LocalPod, tokens: int, n: int, concurrency: int, verify: bool) -> dict[str, Any]:
    def one(i: int) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        code, body = dec.post("/v1/synthetic", {"tokens": tokens, "timeoutS": 120, "verify": verify}, 300)
        if code != 200:
            raise RuntimeError(f"synthetic request failed: HTTP {code}: {body}")
        return time.perf_counter() - t0, body

    one(-1)  # warm: first-touch pages and the connection
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    lat = sorted(x for x, _ in out)
    writes = [b["writeSeconds"] for _, b in out]
    moved = out[0][1]["bytes"]
    return {"concurrency": concurrency, "verify": verify, "requests": n, "bytes_per_request": moved,
            "requests_per_s": n / wall, "latency_s": {"p50": statistics.median(lat),
                                                      "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))]},
            "engine_write_s": {"median": statistics.median(writes)},
            "engine_gbps": moved / statistics.median(writes) / 1e9,
            "end_to_end_gbps": moved * n / wall / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the adapter measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import engines as engines_bench  # bench/engines.py: the adapter, raw and memcpy figures

    print(f"adapter: bench/engines.py mooncake-tcp, {LAYOUT}, {args.tokens} tokens, median of {args.reps}")
    adapter = engines_bench.run_config(engines_bench.CONFIGS["mooncake-tcp"], [args.tokens], args.reps)
    a = adapter["results"][0]
    print(f"  {a['bytes']} bytes in {a['blocks']} blocks: adapter {a['gbps']['adapter']:.3f} GB/s, "
          f"raw {a['gbps']['raw']:.3f} GB/s")

    slots = max(args.concurrency) + 1  # one more for the readiness canary
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pdfleet-bench-serve-") as tmp:
        work = Path(tmp)
        pre = LocalPod(work, "bench-prefill", _config("prefill", args.tokens, slots), SECRET).start()
        dec = LocalPod(work, "bench-decode", _config("decode", args.tokens, slots), SECRET,
                       args=("--canary-period", "600", "--retry-period", "0.5"),
                       env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
        dec.start()
        try:
            t0 = time.perf_counter()
            dec.wait_ready(True, 300)
            print(f"serve: decode ready after {time.perf_counter() - t0:.1f}s")
            for c in args.concurrency:
                for verify in (True, False):
                    r = _level(dec, args.tokens, args.requests, c, verify)
                    levels.append(r)
                    print(f"  concurrency {c} verify {verify!s:5}: {r['requests_per_s']:.2f} req/s, "
                          f"p50 {r['latency_s']['p50'] * 1e3:.0f} ms, p95 {r['latency_s']['p95'] * 1e3:.0f} ms, "
                          f"engine {r['engine_gbps']:.3f} GB/s ({r['engine_gbps'] / a['gbps']['adapter']:.2f} of "
                          f"the adapter), end to end {r['end_to_end_gbps']:.3f} GB/s")
            metrics = {k: v for k, v in dec.metrics().items() if k.startswith(("pdfleet_transfers_total",
                                                                              "pdfleet_transfer_failures"))}
        finally:
            dec.stop()
            pre.stop()
    same = all(r["bytes_per_request"] == a["bytes"] for r in levels)
    report = {"benchmark": "serve", "layout": LAYOUT, "tokens": args.tokens, "requests": args.requests,
              "backend": "mooncake", "protocol": "tcp", "host": {"machine": platform.machine(),
                                                                 "python": platform.python_version()},
              "adapter": {"bytes": a["bytes"], "blocks": a["blocks"], "gbps": a["gbps"], "median_s": a["median_s"]},
              "same_bytes_as_adapter": same, "levels": levels, "decode_metrics": metrics}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"bytes per request equal the adapter's: {same}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
