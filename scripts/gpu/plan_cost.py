"""What a staged plan costs to prepare on the GPU host, per request size: the cut on the host (torch
on the CPU) and on the GPU, and the uploads of a finished table and of the blocks alone; ``.call`` is
the host time of the call, ``.sync`` until the GPU finished. From the repo root on the device:
``python3 scripts/gpu/plan_cost.py`` (medians of 7 after a warm-up, milliseconds)."""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.argv = sys.argv[:1]
import bench.gpu_transfer as g  # noqa: E402
from pdfleet_runtime import staging  # noqa: E402


def _timed(res: dict[str, list[float]], name: str, fn: Callable[[], Any]) -> Any:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    res.setdefault(name + ".call", []).append((t1 - t0) * 1e3)
    res.setdefault(name + ".sync", []).append((t2 - t0) * 1e3)
    return out


def one(tokens: int, dev: torch.device) -> str:
    p1, p2 = g._pools(tokens, "cpu", 1), g._pools(tokens, "cpu", 2)
    r1, r2 = p1.registration(), p2.registration()
    b = g._plan(tokens, r1, r2)
    src, length = b.src - r1.region.address, b.length
    blocks = np.stack([src, length])
    res: dict[str, list[float]] = {}
    for _ in range(8):
        tab = _timed(res, "host", lambda: staging.StagePlan.build(src, length, 256 << 20)).table
        _timed(res, "gpu", lambda: staging.StagePlan.build(src, length, 256 << 20, device=dev))
        _timed(res, "gpu_64MiB", lambda: staging.StagePlan.build(src, length, 64 << 20, device=dev))
        _timed(res, "table_upload", lambda t=tab: t.to(dev))
        _timed(res, "blocks_upload", lambda: torch.from_numpy(blocks).to(dev))
    return f"{tokens} blocks {b.descriptors} pieces {len(tab)} " + " ".join(
        f"{k}={statistics.median(v[1:]):.3f}" for k, v in res.items())


if __name__ == "__main__":
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    for t in (4096, 32768, 131072):
        print(one(t, device), flush=True)
