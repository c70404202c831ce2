"""The parity harness: does decode end up holding exactly the state aggregate serving would have?

Steps (design.md section 2, "Correctness oracle"):

1. Ask the capability matrix; a rejected combination is reported with its rule and reason.
2. Build every prefill and decode rank's pools; fill every arena with seeded background bytes.
3. Allocate each request fragmented pages, a slot and a row on both instances (different seeds).
4. For each logical buffer (state type, field, layer) draw the request's logical (unsharded)
   bytes from the seed and write them, sharded for the prefill shape, into prefill pools.
5. Compile each decode rank's plan, plan every request, run the blocks with ``LocalCopyExecutor``.
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
from dataclasses import dataclass, field

import numpy as np
import torch

from pdfleet_runtime.layouts import (
    Layout,
    LayoutError,
    StateType,
    rank_buffers,
)
from pdfleet_runtime.planner import Blocks, PlanError, check_shapes, compile_destination, source_ranks
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.records import ParallelShape, RequestIndices
from pdfleet_runtime.seeded import background, logical_items, request_lengths, shard_logical

__all__ = [
    "BACKENDS",
    "ENGINE_BACKENDS",
    "PRECHECK_RULE",
    "LocalCopyExecutor",
    "Mismatch",
    "ParityConfig",
    "ParityResult",
    "Rejection",
    "check_matrix",
    "precheck",
    "run_parity",
    "run_parity_engine",
]

BACKENDS = ("local", "mooncake", "nixl", "mori")
"""``--backend`` values. ``local`` checks the Mooncake column (the reference semantics). ``run_parity``
runs every backend's column with the in-process copy executor; ``run_parity_engine`` (the CLI's
``mooncake`` and ``nixl``) runs every rank as its own process through the real engine and the protocol."""

ENGINE_BACKENDS = ("mooncake", "nixl")

PRECHECK_RULE = "runtime-precheck"
"""Rule id of a rejection by the runtime's own shape checks rather than by the matrix."""

@dataclass(frozen=True)
class ParityConfig:
    layout: Layout
    prefill: ParallelShape
    decode: ParallelShape
    requests: int = 8
    tokens: int = 4096
    seed: int = 7
    backend: str = "local"
    layout_name: str = "inline"
    device: str = "cpu"
    protocol: str = "tcp"
    """The engine backends' ``spec.transfer.protocol`` (``tcp`` on host memory, ``nvlink`` on GPUs)."""


@dataclass(frozen=True)
class Rejection:
    """The matrix said no: the rule id, the message and the reason."""

    rule: str
    message: str
    reason: str


@dataclass(frozen=True)
class Mismatch:
    """The first differing byte of a decode buffer."""

    rank: int
    state_type: str
    field: str
    layer_id: int
    item: int
    offset: int

    def describe(self) -> str:
        return (f"decode rank {self.rank}: {self.state_type}/{self.field} layer {self.layer_id} item {self.item} "
                f"byte offset {self.offset}")


@dataclass
class ParityResult:
    ok: bool
    bytes_moved: int = 0
    descriptors: int = 0
    mismatched_bytes: int = 0
    bytes_by_state: dict[str, int] = field(default_factory=dict)
    descriptors_by_state: dict[str, int] = field(default_factory=dict)
    request_tokens: list[int] = field(default_factory=list)
    first_mismatch: Mismatch | None = None
    rejection: Rejection | None = None
    plan_seconds: float = 0.0
    copy_seconds: float = 0.0

    def as_json(self, cfg: ParityConfig) -> dict[str, object]:
        return {
            "ok": self.ok,
            "layout": cfg.layout_name,
            "prefill": str(cfg.prefill),
            "decode": str(cfg.decode),
            "backend": cfg.backend,
            "device": cfg.device,
            "protocol": cfg.protocol,
            "bytes_moved": self.bytes_moved,
            "descriptors": self.descriptors,
            "mismatched_bytes": self.mismatched_bytes,
            "bytes_by_state": self.bytes_by_state,
            "descriptors_by_state": self.descriptors_by_state,
            "request_tokens": self.request_tokens,
            "first_mismatch": self.first_mismatch.describe() if self.first_mismatch else None,
            "rejected": None if self.rejection is None else {
                "rule": self.rejection.rule, "message": self.rejection.message, "reason": self.rejection.reason},
            "plan_seconds": round(self.plan_seconds, 6),
            "copy_seconds": round(self.copy_seconds, 6),
        }


# --------------------------------------------------------------------------- matrix


def check_matrix(cfg: ParityConfig) -> Rejection | None:
    """The first error the capability matrix reports for this combination, or None if admitted."""
    from pdfleet_runtime import matrix  # imported here: the matrix pulls in versions and transports
    from pdfleet_runtime.layouts import PRESETS

    named = cfg.layout_name in PRESETS and PRESETS[cfg.layout_name] == cfg.layout
    facts = matrix.layout_facts(cfg.layout_name if named else cfg.layout)
    backend = "mooncake" if cfg.backend == "local" else cfg.backend
    # Capacity of the run; the GPU memory default is the matrix's own.
    def role(s: ParallelShape) -> matrix.RoleShape:
        return matrix.RoleShape(tensor=s.tp, pipeline=s.pp, max_requests=cfg.requests, kv_tokens=cfg.tokens)

    verdict = matrix.evaluate(matrix.MatrixInput(facts, backend, "rdma", role(cfg.prefill), role(cfg.decode)))
    if verdict.admitted:
        return None
    v = verdict.violations[0]
    return Rejection(v.rule, v.message, v.reason)


# --------------------------------------------------------------------------- executor


class LocalCopyExecutor:
    """Copies blocks between registered arenas of this process (cpu or cuda tensors).

    Every block must lie inside one registered region on each side; addresses are resolved
    with one vectorized lookup, then copied per block.
    """

    def __init__(self, arenas: list[torch.Tensor]) -> None:
        order = sorted(arenas, key=lambda a: a.data_ptr())
        self._arenas = order
        self._bases = np.array([a.data_ptr() for a in order], dtype=np.int64)
        self._ends = self._bases + np.array([a.numel() for a in order], dtype=np.int64)
        self._views = [a.numpy() if a.device.type == "cpu" else a for a in order]

    def _resolve(self, addr: np.ndarray, length: np.ndarray, side: str) -> np.ndarray:
        region = np.searchsorted(self._bases, addr, side="right") - 1
        bad = (region < 0) | (addr + length > self._ends[np.maximum(region, 0)])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{side} block at {addr[i]:#x} (+{length[i]}) is outside every registered region")
        return region

    def execute(self, blocks: Blocks) -> None:
        if not blocks.descriptors:
            return
        sr = self._resolve(blocks.src, blocks.length, "source")
        dr = self._resolve(blocks.dst, blocks.length, "destination")
        so = (blocks.src - self._bases[sr]).tolist()
        do = (blocks.dst - self._bases[dr]).tolist()
        for s_reg, d_reg, s, d, n in zip(sr.tolist(), dr.tolist(), so, do, blocks.length.tolist(), strict=True):
            self._views[d_reg][d : d + n] = self._views[s_reg][s : s + n]


# --------------------------------------------------------------------------- the run


def _fill_background(pools: RankPools, seed: int, side: int) -> np.ndarray:
    data = background(seed, side, pools.shape.rank(pools.tp_rank, pools.pp_rank), pools.arena.numel())
    pools.arena.copy_(torch.from_numpy(data))
    return data


def _write_requests(
    side: list[RankPools], seed: int, reqs: list[RequestIndices], targets: list[np.ndarray] | None
) -> None:
    """Write every request's logical bytes, sharded per rank, at its items on every rank of one side.

    Into the pools themselves when ``targets`` is None (prefill), else into ``targets`` (numpy
    copies of the arenas: the expected decode bytes). Each logical buffer is drawn once per
    request and sharded for every rank that holds it.
    """
    holders: dict[tuple[object, ...], list[tuple[int, int]]] = defaultdict(list)
    for r, pools in enumerate(side):
        for i, rec in enumerate(pools.records):
            holders[(rec.spec.state_type, rec.spec.field, rec.spec.layer_id)].append((r, i))
    for places in holders.values():
        first = side[places[0][0]]
        spec = first.records[places[0][1]].spec
        tp = first.shape.tp
        for q, idx in enumerate(reqs):
            items = idx.of(spec.index)
            if not items.size:
                continue
            logical = logical_items(seed, spec, tp, q, items.size)
            for r, i in places:
                pools = side[r]
                data = shard_logical(logical, spec, tp, pools.tp_rank)
                rec = pools.records[i]
                if targets is not None or pools.arena.device.type == "cpu":
                    arena = targets[r] if targets is not None else pools.arena.numpy()
                    off = rec.address - pools.region.address
                    arena[off : off + rec.total_bytes].reshape(rec.count, spec.item_bytes)[items] = data
                else:
                    dev = pools.arena.device
                    pools.byte_view(i).index_copy_(0, torch.from_numpy(items.copy()).to(dev),
                                                   torch.from_numpy(data).to(dev))


def _compare(pools: RankPools, expected: np.ndarray) -> tuple[int, Mismatch | None]:
    actual = pools.arena.cpu().numpy()
    diff = np.flatnonzero(actual != expected)
    if not diff.size:
        return 0, None
    first = int(diff[0])
    base = pools.region.address
    for rec in pools.records:
        off = rec.address - base
        if off <= first < off + rec.total_bytes:
            item, byte = divmod(first - off, rec.spec.item_bytes)
            s = rec.spec
            return int(diff.size), Mismatch(pools.shape.rank(pools.tp_rank, pools.pp_rank), s.state_type.value,
                                            s.field.value, int(s.layer_id), item, byte)
    return int(diff.size), Mismatch(pools.shape.rank(pools.tp_rank, pools.pp_rank), "padding", "-", -1, -1, first)


def precheck(cfg: ParityConfig, *, check_with_matrix: bool = True) -> Rejection | None:
    """The matrix's verdict, then the runtime's own limits (in case the matrix admits what the layout
    cannot be split into); None when the combination may run."""
    if check_with_matrix:
        rejection = check_matrix(cfg)
        if rejection is not None:
            return rejection
    try:
        check_shapes(cfg.prefill, cfg.decode)
        for shape in (cfg.prefill, cfg.decode):
            for k in range(shape.pp):
                rank_buffers(cfg.layout, shape.tp, shape.pp, 0, k)
    except (LayoutError, PlanError) as e:
        return Rejection(PRECHECK_RULE, str(e), "the runtime cannot split this layout over these shapes "
                         "(the matrix admitted it)")
    return None


def run_parity_engine(cfg: ParityConfig, workdir: str | None = None) -> ParityResult:
    """Parity through a real engine: every rank its own process on loopback, talking the protocol.

    Same checks and result as ``run_parity``; a rejected combination returns before any process starts.
    """
    import tempfile
    from pathlib import Path

    from pdfleet_runtime.multiproc import CaseSpec, GroupSpec, run_group

    rejection = precheck(cfg)
    if rejection is not None:
        return ParityResult(ok=False, rejection=rejection)
    from pdfleet_runtime.transfer import Protocol

    group = GroupSpec(cfg.backend, cfg.prefill, cfg.decode, (CaseSpec(cfg.layout_name, cfg.requests, cfg.tokens,
                                                                      cfg.seed),),
                      device="cpu" if cfg.device == "cpu" else "cuda", protocol=Protocol(cfg.protocol))
    with tempfile.TemporaryDirectory(prefix="pdfleet-parity-", dir=workdir) as tmp:
        return run_group(group, Path(tmp))[0]  # type: ignore[no-any-return]


def run_parity(cfg: ParityConfig, *, check_with_matrix: bool = True, tamper: object = None) -> ParityResult:
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
        _fill_background(pools, cfg.seed, 1)
    backgrounds = {k: _fill_background(pools, cfg.seed, 2) for k, pools in decode.items()}
    src_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 1)
    dst_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 2)
    src_reqs = [src_alloc.allocate(n) for n in lengths]
    dst_reqs = [dst_alloc.allocate(n) for n in lengths]
    _write_requests(list(prefill.values()), cfg.seed, src_reqs, None)

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
        blocks = tamper(blocks)  # type: ignore[operator]
    LocalCopyExecutor([v.arena for v in (*prefill.values(), *decode.values())]).execute(blocks)
    t2 = time.perf_counter()

    mismatched, first = 0, None
    expected = [backgrounds[k] for k in decode]
    _write_requests(list(decode.values()), cfg.seed, dst_reqs, expected)
    for pools, want in zip(decode.values(), expected, strict=True):
        n, m = _compare(pools, want)
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

