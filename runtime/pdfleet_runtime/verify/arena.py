"""Arena checks: seeded background, a request's logical bytes written per rank, and the byte-wise comparison.

The harness's hands on the pools (torch): ``fill_background`` before a run, ``write_requests`` into
the prefill pools (or into numpy copies of decode arenas: what they must hold afterwards), and
``compare`` (every byte of an arena, so writes outside a request's pages, slots and rows show).
``LocalCopyExecutor`` moves planned blocks between arenas of one process (the in-process parity run).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from pdfleet_runtime.engines.blocks import RegionTable
from pdfleet_runtime.engines.errors import Side
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.records import RegionRecord, RequestIndices
from pdfleet_runtime.seeded import background, logical_items, shard_logical

__all__ = ["LocalCopyExecutor", "Mismatch", "compare", "fill_background", "write_requests"]


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


class LocalCopyExecutor:
    """Copies blocks between registered arenas of this process (cpu or cuda tensors).

    Blocks are checked against the arenas with the engines' own ``RegionTable`` (one vectorized
    lookup; ``BlockRangeError`` for a block outside every arena), then copied per block with tensor
    views, which also reach GPU memory (the ``local`` engine's ``memmove`` copies host memory only).
    """

    def __init__(self, arenas: list[torch.Tensor]) -> None:
        order = sorted(arenas, key=lambda a: a.data_ptr())
        regions = [RegionRecord(a.data_ptr(), a.numel(), str(a.device)) for a in order]
        self._src, self._dst = RegionTable(regions, Side.LOCAL), RegionTable(regions, Side.REMOTE)
        self._views = [a.numpy() if a.device.type == "cpu" else a for a in order]

    def execute(self, blocks: Blocks) -> None:
        if not blocks.descriptors:
            return
        sr = self._src.check(blocks.src, blocks.length)
        dr = self._dst.check(blocks.dst, blocks.length)
        so = (blocks.src - self._src.bases[sr]).tolist()
        do = (blocks.dst - self._dst.bases[dr]).tolist()
        for s_reg, d_reg, s, d, n in zip(sr.tolist(), dr.tolist(), so, do, blocks.length.tolist(), strict=True):
            self._views[d_reg][d : d + n] = self._views[s_reg][s : s + n]


def fill_background(pools: RankPools, seed: int, side: int) -> np.ndarray:
    """Fill the arena with ``seeded.background`` bytes (``side`` 1 prefill, 2 decode); a numpy copy of them."""
    data = background(seed, side, pools.shape.rank(pools.tp_rank, pools.pp_rank), pools.arena.numel())
    pools.arena.copy_(torch.from_numpy(data))
    return data


def write_requests(
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


def compare(pools: RankPools, expected: np.ndarray) -> tuple[int, Mismatch | None]:
    """Bytes of the arena that differ from ``expected``, and where the first one lies."""
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
