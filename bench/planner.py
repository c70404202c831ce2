"""Planning cost and descriptor counts: pdfleet's vectorized planner vs a naive per-token planner.

One ``qwen3.8-flash-next`` request of 32k tokens (page 64, 512 pages, allocated fragmented on
both sides) in the shapes 4->4, 4->2, 2->4 and tp4,pp2->tp4,pp1, planned for every decode rank
of the deployment between virtual registrations (no memory is allocated).

The naive planner is measured in the same run. It is shaped like SGLang 0.5.23's Mooncake sender:
equal TP groups pages into runs that are contiguous on both sides (a Python loop) and emits one
descriptor per run per layer entry; heterogeneous TP emits one descriptor per token per KV entry
(a token-major page cannot hand out a head slice of a page in one piece); slot and row states get
one descriptor per slot (per row and shard group for sliced conv state). It uses the same writer
election, so both planners move the same bytes, which the bench asserts.

Usage: PYTHONPATH=runtime python bench/planner.py [--repeat N] [--tokens 32768] [--out PATH]
(default output bench/results/planner-<UTC time>.json)
Targets (issue 5): under 1 ms per request at equal TP; heterogeneous-TP KV descriptors at most
pages x KV entries per decode rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from pdfleet_runtime.layouts import PRESETS, IndexKind, Sharding, StateType, pages_for_tokens
from pdfleet_runtime.planner import (
    STATE_ORDER,
    Blocks,
    DestinationPlan,
    compile_destination,
    elect_sentinel_stages,
    head_blocks,
    should_send_head,
    should_send_replicated,
    slice_blocks,
    source_ranks,
)
from pdfleet_runtime.records import ParallelShape, RankRegistration, RequestIndices, virtual_registration

LAYOUT = "qwen3.8-flash-next"
SHAPES = {
    "4->4": (ParallelShape(4), ParallelShape(4)),
    "4->2": (ParallelShape(4), ParallelShape(2)),
    "2->4": (ParallelShape(2), ParallelShape(4)),
    "pp2->pp1": (ParallelShape(4, 2), ParallelShape(4, 1)),
}


def _request(tokens: int, page: int, pool_pages: int, rng: np.random.Generator) -> RequestIndices:
    n = pages_for_tokens(tokens, page)
    return RequestIndices(rng.choice(pool_pages, size=n, replace=False), slot=int(rng.integers(4)),
                          row=int(rng.integers(4)))


def naive_plan(src: RankRegistration, dst: RankRegistration, si: RequestIndices, di: RequestIndices,
               sentinel_stage: dict) -> tuple[int, int, int]:
    """(descriptors, bytes, KV descriptors) of the per-run/per-token approach, with Python loops."""
    out: list[tuple[int, int, int]] = []
    kv_desc = 0
    p, d = src.shape.tp, dst.shape.tp
    dst_by_key = {(b.spec.state_type, b.spec.field, b.spec.layer_id): b for b in dst.buffers}
    for a in src.buffers:
        b = dst_by_key.get((a.spec.state_type, a.spec.field, a.spec.layer_id))
        if b is None or sentinel_stage.get(a.spec.key, src.pp_rank) != src.pp_rank:
            continue
        spec = a.spec
        s_idx, d_idx = si.of(spec.index).tolist(), di.of(spec.index).tolist()
        if spec.sharding is Sharding.HEADS and p != d:
            if not should_send_head(p, d, src.tp_rank, spec.total_heads):
                continue
            (so, do, n), = head_blocks(head_bytes=spec.unit_bytes, total_heads=spec.total_heads, src_tp=p, dst_tp=d,
                                       src_rank=src.tp_rank, dst_rank=dst.tp_rank)
            page = spec.item_shape[1]
            per_tok = n // page  # token-major pages: a head slice is one piece per token
            for sp, dp in zip(s_idx, d_idx, strict=True):
                for t in range(page):
                    out.append((a.address + sp * a.item_bytes + so + t * per_tok,
                                b.address + dp * b.item_bytes + do + t * per_tok, per_tok))
                    kv_desc += 1
            continue
        if spec.sharding is Sharding.REPLICATED:
            if not should_send_replicated(p, d, src.tp_rank):
                continue
            blocks = [(0, 0, a.item_bytes)]
        elif spec.sharding is Sharding.HEADS:
            blocks = [(0, 0, a.item_bytes)]
        else:
            blocks = slice_blocks(src_item_len=a.item_bytes, dst_item_len=b.item_bytes, src_dim=spec.dim,
                                  dst_dim=b.spec.dim, outer_count=spec.outer_count, src_tp=p, dst_tp=d,
                                  src_rank=src.tp_rank, dst_rank=dst.tp_rank, shard_groups=spec.shard_groups)
        whole = blocks == [(0, 0, a.item_bytes)] and a.item_bytes == b.item_bytes
        if whole and spec.index in (IndexKind.PAGE, IndexKind.SWA_PAGE):
            runs = []  # group_concurrent_contiguous, in Python
            start = 0
            for i in range(1, len(s_idx) + 1):
                if i == len(s_idx) or s_idx[i] != s_idx[i - 1] + 1 or d_idx[i] != d_idx[i - 1] + 1:
                    runs.append((start, i))
                    start = i
            for lo, hi in runs:
                out.append((a.address + s_idx[lo] * a.item_bytes, b.address + d_idx[lo] * b.item_bytes,
                            (hi - lo) * a.item_bytes))
                kv_desc += spec.state_type is StateType.KV
            continue
        for sp, dp in zip(s_idx, d_idx, strict=True):
            for so, do, n in blocks:
                out.append((a.address + sp * a.item_bytes + so, b.address + dp * b.item_bytes + do, n))
                kv_desc += spec.state_type is StateType.KV
    return len(out), sum(n for _, _, n in out), kv_desc


def _kv(blocks: Blocks) -> int:
    return int((blocks.state == STATE_ORDER.index(StateType.KV)).sum())


def bench_shape(name: str, p: ParallelShape, d: ParallelShape, tokens: int, repeat: int, seed: int) -> dict:
    lay = PRESETS[LAYOUT]
    reqs, cap_tokens = 4, 4 * tokens
    srcs = {(t, k): virtual_registration(lay, p, t, k, reqs, cap_tokens, base=(1 << 40) + (p.rank(t, k) << 36))
            for t, k in p.coords()}
    dsts = {(t, k): virtual_registration(lay, d, t, k, reqs, cap_tokens, base=(1 << 47) + (d.rank(t, k) << 36))
            for t, k in d.coords()}
    pool_pages = next(b.count for b in next(iter(srcs.values())).buffers if b.spec.index is IndexKind.PAGE)
    rng = np.random.default_rng(seed)
    si, di = _request(tokens, lay.page_size, pool_pages, rng), _request(tokens, lay.page_size, pool_pages, rng)
    t0 = time.perf_counter()
    plans: dict[tuple[int, int], DestinationPlan] = {
        k: compile_destination(reg, [srcs[s] for s in source_ranks(p, d, *k)]) for k, reg in dsts.items()}
    compile_s = time.perf_counter() - t0

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        results = {k: plan.plan(si, di) for k, plan in plans.items()}
        times.append(time.perf_counter() - t0)
    per_dst = {k: Blocks.concat(list(r.values())) for k, r in results.items()}
    desc = sum(b.descriptors for b in per_dst.values())
    moved = sum(b.bytes for b in per_dst.values())
    kv_per_dst = max(_kv(b) for b in per_dst.values())

    t0 = time.perf_counter()
    naive_desc = naive_bytes = naive_kv = 0
    for k, reg in dsts.items():
        sources = [srcs[s] for s in source_ranks(p, d, *k)]
        stages = elect_sentinel_stages(sources)
        kv_here = 0
        for s in sources:
            n, b, kvd = naive_plan(s, reg, si, di, stages)
            naive_desc += n
            naive_bytes += b
            kv_here += kvd
        naive_kv = max(naive_kv, kv_here)
    naive_s = time.perf_counter() - t0
    assert naive_bytes == moved, f"{name}: naive moved {naive_bytes} bytes, vectorized {moved}"

    pages = si.pages.size
    kv_entries = 2 * len(lay.full_attention_layer_ids)
    med = statistics.median(times)
    return {
        "shape": name, "prefill": str(p), "decode": str(d), "tokens": tokens, "pages": pages,
        "decode_ranks": len(dsts), "compile_ms": round(compile_s * 1e3, 3),
        "plan_ms_per_request": round(med * 1e3, 4),
        "plan_ms_per_request_per_decode_rank": round(med * 1e3 / len(dsts), 4),
        "descriptors": desc, "kv_descriptors_max_per_decode_rank": kv_per_dst,
        "kv_target_pages_x_entries": pages * kv_entries, "bytes": moved,
        "naive_plan_ms_per_request": round(naive_s * 1e3, 2), "naive_descriptors": naive_desc,
        "naive_kv_descriptors_max_per_decode_rank": naive_kv,
        "speedup": round(naive_s / med, 1), "descriptor_ratio": round(naive_desc / desc, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=7)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / f"planner-{stamp}.json"))
    args = ap.parse_args()
    rows = [bench_shape(n, p, d, args.tokens, args.repeat, args.seed) for n, (p, d) in SHAPES.items()]
    print(f"{LAYOUT}, one request of {args.tokens} tokens, fragmented pages; 'plan ms' and 'naive ms' cover "
          "every decode rank of the deployment, 'ms/rank' one decode rank")
    print(f"{'shape':9} {'ms/rank':>8} {'plan ms':>9} {'naive ms':>10} {'speedup':>8} {'desc':>8} {'naive desc':>11} {'ratio':>6} "
          f"{'KV desc/rank':>13} {'pages x KV entries':>19}")
    for r in rows:
        print(f"{r['shape']:9} {r['plan_ms_per_request_per_decode_rank']:>8.3f} {r['plan_ms_per_request']:>9.3f} {r['naive_plan_ms_per_request']:>10.1f} "
              f"{r['speedup']:>7.0f}x {r['descriptors']:>8} {r['naive_descriptors']:>11} {r['descriptor_ratio']:>5.1f}x "
              f"{r['kv_descriptors_max_per_decode_rank']:>13} {r['kv_target_pages_x_entries']:>19}")
    # Each decode rank plans in its own process, so the target applies per decode rank; the
    # whole-deployment figure (every decode rank's plans, serially here) is printed alongside.
    ok_time = all(r["plan_ms_per_request_per_decode_rank"] < 1.0 for r in rows
                  if r["prefill"].split(",")[0] == r["decode"].split(",")[0])
    ok_kv = all(r["kv_descriptors_max_per_decode_rank"] <= r["kv_target_pages_x_entries"] for r in rows)
    print(f"targets: equal-TP plan < 1 ms per decode rank: {'met' if ok_time else 'MISSED'}; "
          f"KV descriptors <= pages x KV entries: {'met' if ok_kv else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "planner", "layout": LAYOUT, "host": platform.node(),
                               "python": platform.python_version(), "numpy": np.__version__,
                               "targets_met": {"equal_tp_under_1ms": ok_time, "kv_descriptors": ok_kv},
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok_time and ok_kv else 1


if __name__ == "__main__":
    raise SystemExit(main())
