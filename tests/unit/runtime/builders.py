"""Builders for runtime test objects: tiny inline layouts and plans between virtual registrations."""

from __future__ import annotations

from pdfleet_runtime.layouts import (
    LayerSet,
    Layout,
    LinearAttentionConfig,
    PLEConfig,
    QSAConfig,
)
from pdfleet_runtime.planner import Blocks, compile_destination, source_ranks
from pdfleet_runtime.pools import Capacity, RequestAllocator
from pdfleet_runtime.records import ParallelShape, virtual_registration


def tiny_hybrid(
    num_layers: int = 8,
    *,
    interval: int = 4,
    kv_heads: int = 2,
    qsa: bool = True,
    ple: bool = True,
    page_size: int = 4,
) -> Layout:
    """A Qwen3-Next-shaped layout with small dims (every state type except SWA)."""
    return Layout(
        num_layers=num_layers,
        full_attention_layers=LayerSet(interval=interval, offset=interval - 1),
        kv_heads=kv_heads,
        head_dim=4,
        page_size=page_size,
        linear_attention=LinearAttentionConfig(
            num_key_heads=4, num_value_heads=8, key_head_dim=2, value_head_dim=2, conv_kernel=3
        ),
        qsa=QSAConfig(compress_ratio=2, index_heads=2, index_head_dim=2) if qsa else None,
        ple=PLEConfig(short_conv_layers=LayerSet(interval=1), short_conv_width=4, short_conv_kernel=2,
                      ngram_context=3) if ple else None,
    )


def plan_all(
    layout: Layout,
    prefill: ParallelShape,
    decode: ParallelShape,
    lengths: list[int],
    *,
    seed: int = 1,
) -> dict[tuple[int, int], dict[int, Blocks]]:
    """Plan every request between virtual registrations; ``{(dst tp, dst pp): {src rank: blocks}}``."""
    reqs, toks = len(lengths), sum(lengths)
    cap = Capacity(reqs, toks)
    src_alloc = RequestAllocator(layout, cap, seed=seed)
    dst_alloc = RequestAllocator(layout, cap, seed=seed + 1)
    src_idx = [src_alloc.allocate(n) for n in lengths]
    dst_idx = [dst_alloc.allocate(n) for n in lengths]
    srcs = {
        (t, p): virtual_registration(layout, prefill, t, p, reqs, toks, base=(1 << 40) + (prefill.rank(t, p) << 34))
        for t, p in prefill.coords()
    }
    out: dict[tuple[int, int], dict[int, Blocks]] = {}
    for t, p in decode.coords():
        dst = virtual_registration(layout, decode, t, p, reqs, toks, base=(1 << 46) + (decode.rank(t, p) << 34))
        plan = compile_destination(dst, [srcs[k] for k in source_ranks(prefill, decode, t, p)])
        per_src: dict[int, list[Blocks]] = {}
        for s, d in zip(src_idx, dst_idx, strict=True):
            for rank, blocks in plan.plan(s, d).items():
                per_src.setdefault(rank, []).append(blocks)
        out[(t, p)] = {r: Blocks.concat(b) for r, b in per_src.items()}
    return out
