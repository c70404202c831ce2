"""The parity harness: does decode end up holding exactly the state aggregate serving would have?

Steps (design.md section 2, "Correctness oracle"):

1. Ask the capability matrix; a rejected combination is reported with its rule and reason.
2. Build every prefill and decode rank's pools; fill every arena with seeded background bytes.
3. Allocate each request fragmented pages, a slot and a row on both instances (different seeds).
4. For each logical buffer (state type, field, layer) draw the request's logical (unsharded)
   bytes from the seed and write them, sharded for the prefill shape, into prefill pools.
5. Compile each decode rank's plan, plan every request, run the blocks with ``arena.LocalCopyExecutor``.
6. Rebuild each decode arena as expected (background, plus the logical bytes sharded for the
   decode shape at the request's items) and compare every byte, so bytes outside the request's
   pages, slots and rows must be untouched too.

Sharding here (``seeded.shard_logical``) slices a logical array by rank; the planner computes byte
offsets. The two are written independently, so agreement is evidence, not a tautology; the
bytes moved per state type are also checked against closed forms in the tests.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from pdfleet_runtime.layouts import StateType
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks, compile_destination, source_ranks
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.seeded import request_lengths

from .arena import LocalCopyExecutor, compare, fill_background, write_requests
from .cases import CaseSpec, GroupSpec
from .group import run_group
from .precheck import precheck
from .results import ParityConfig, ParityResult

__all__ = ["BACKENDS", "ENGINE_BACKENDS", "run_parity", "run_parity_engine"]

BACKENDS = ("local", "mooncake", "nixl", "mori")
"""``--backend`` values. ``local`` checks the Mooncake column (the reference semantics). ``run_parity``
runs every backend's column with the in-process copy executor; ``run_parity_engine`` (the CLI's
``mooncake`` and ``nixl``) runs every rank as a serving rank process (``rank.process``) through the real
engine and the protocol."""

ENGINE_BACKENDS = ("mooncake", "nixl")


def run_parity_engine(cfg: ParityConfig) -> ParityResult:
    """Parity through a real engine: every rank a serving rank process on loopback, talking the protocol.

    Same checks and result as ``run_parity``; a rejected combination returns before any process starts.
    """
    rejection = precheck(cfg)
    if rejection is not None:
        return ParityResult(ok=False, rejection=rejection)
    group = GroupSpec(cfg.backend, cfg.prefill, cfg.decode, (CaseSpec(cfg.layout_name, cfg.requests, cfg.tokens,
                                                                      cfg.seed),),
                      device="cpu" if cfg.device == "cpu" else "cuda", protocol=LinkProtocol(cfg.protocol))
    return run_group(group)[0]


def run_parity(cfg: ParityConfig, *, check_with_matrix: bool = True,
               tamper: Callable[[Blocks], Blocks] | None = None) -> ParityResult:
    """Run the harness. ``tamper(blocks) -> blocks`` (tests only) corrupts the plan to show detection."""
    rejection = precheck(cfg, check_with_matrix=check_with_matrix)
    if rejection is not None:
        return ParityResult(ok=False, rejection=rejection)
    lay, P, D = cfg.layout, cfg.prefill, cfg.decode
    lengths = request_lengths(cfg.tokens, cfg.requests, cfg.seed)
    cap = Capacity(cfg.requests, cfg.tokens)
    prefill = {(t, p): RankPools(lay, P, t, p, cap, cfg.device) for t, p in P.coords()}
    decode = {(t, p): RankPools(lay, D, t, p, cap, cfg.device) for t, p in D.coords()}
    for pools in prefill.values():
        fill_background(pools, cfg.seed, 1)
    backgrounds = {k: fill_background(pools, cfg.seed, 2) for k, pools in decode.items()}
    src_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 1)
    dst_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 2)
    src_reqs = [src_alloc.allocate(n) for n in lengths]
    dst_reqs = [dst_alloc.allocate(n) for n in lengths]
    write_requests(list(prefill.values()), cfg.seed, src_reqs, None)

    t0 = time.perf_counter()
    registrations = {k: v.registration() for k, v in prefill.items()}
    plans: list[Blocks] = []
    for (t, p), pools in decode.items():
        srcs = [registrations[k] for k in source_ranks(P, D, t, p)]
        dest = compile_destination(pools.registration(), srcs)
        for s_idx, d_idx in zip(src_reqs, dst_reqs, strict=True):
            plans.extend(dest.plan(s_idx, d_idx).values())
    blocks = Blocks.concat(plans)
    t1 = time.perf_counter()
    if tamper is not None:
        blocks = tamper(blocks)
    LocalCopyExecutor([v.arena for v in (*prefill.values(), *decode.values())]).execute(blocks)
    t2 = time.perf_counter()

    mismatched, first = 0, None
    expected = [backgrounds[k] for k in decode]
    write_requests(list(decode.values()), cfg.seed, dst_reqs, expected)
    for pools, want in zip(decode.values(), expected, strict=True):
        n, m = compare(pools, want)
        mismatched += n
        first = first or m
    desc: dict[str, int] = defaultdict(int)
    for code, count in zip(*np.unique(blocks.state, return_counts=True), strict=True):
        desc[list(StateType)[int(code)].value] += int(count)
    return ParityResult(
        ok=mismatched == 0, bytes_moved=blocks.bytes, descriptors=blocks.descriptors, mismatched_bytes=mismatched,
        bytes_by_state=blocks.bytes_by_state(), descriptors_by_state=dict(desc), request_tokens=lengths,
        first_mismatch=first, plan_seconds=t1 - t0, copy_seconds=t2 - t1,
    )

