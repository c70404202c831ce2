"""A rank's seeded arena (parity): background bytes, what each request left there, and the whole-arena check.

A rank process only (torch). ``SeededArenaOp`` fills the arena with ``seeded.background``; a decode
rank then notes every request that ended in its items (``wrote``: the request's seeded state;
``dirty``: a failed request's items, which may hold a partial write) and ``check`` rebuilds, in that
order, what the arena must hold and compares every byte, so a write outside a request's pages,
slots and rows shows. The in-process harness (``verify.parity``) uses the same fill and comparison.
"""

from __future__ import annotations

import numpy as np
import torch

from pdfleet_runtime.engines import cuda as cuda_facts
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.records import RequestIndices
from pdfleet_runtime.seeded import background

from .pipe import ArenaCheck, Mismatch
from .synthetic import request_shards

__all__ = ["SeededArena", "compare", "fill_background", "item_rows"]


def fill_background(pools: RankPools, seed: int, side: int) -> np.ndarray:
    """Fill the arena with ``seeded.background`` bytes (``side`` 1 prefill, 2 decode); a numpy copy of them."""
    data = background(seed, side, pools.shape.rank(pools.tp_rank, pools.pp_rank), pools.arena.numel())
    pools.arena.copy_(torch.from_numpy(data))
    cuda_facts.synchronize(pools.region.device)  # engines may read on streams of their own
    return data


def item_rows(arena: np.ndarray, pools: RankPools, buffer: int) -> np.ndarray:
    """One buffer of a numpy arena as ``[items, item_bytes]`` (a view: writes land in ``arena``)."""
    rec = pools.records[buffer]
    off = rec.address - pools.region.address
    return arena[off : off + rec.total_bytes].reshape(rec.count, rec.spec.item_bytes)


def compare(pools: RankPools, expected: np.ndarray) -> tuple[int, Mismatch | None]:
    """Bytes of the arena that differ from ``expected``, and where the first one lies."""
    actual = pools.arena.cpu().numpy()
    diff = np.flatnonzero(actual != expected)
    if not diff.size:
        return 0, None
    first = int(diff[0])
    base = pools.region.address
    rank = pools.shape.rank(pools.tp_rank, pools.pp_rank)
    for rec in pools.records:
        off = rec.address - base
        if off <= first < off + rec.total_bytes:
            item, byte = divmod(first - off, rec.spec.item_bytes)
            s = rec.spec
            return int(diff.size), Mismatch(rank, s.state_type.value, s.field.value, int(s.layer_id), item, byte)
    return int(diff.size), Mismatch(rank, "padding", "-", -1, -1, first)


class SeededArena:
    """The background of one rank's arena and, in order, what each request since left in it."""

    def __init__(self, pools: RankPools, seed: int, side: int) -> None:
        self.pools = pools
        self.background = fill_background(pools, seed, side)
        self._ended: list[tuple[RequestIndices, int | None]] = []

    def wrote(self, idx: RequestIndices, seed: int) -> None:
        """A request succeeded into ``idx``: its items hold the state of ``seed``."""
        self._ended.append((idx, seed))

    def dirty(self, idx: RequestIndices) -> None:
        """A failed request's items, given back: they may hold a partial write (compared as "don't care"
        unless a later request succeeds into them)."""
        self._ended.append((idx, None))

    def check(self) -> ArenaCheck:
        expected = self.background.copy()
        actual = self.pools.arena.cpu().numpy()
        for idx, seed in self._ended:
            if seed is None:
                for i, rec in enumerate(self.pools.records):
                    items = idx.of(rec.spec.index)
                    item_rows(expected, self.pools, i)[items] = item_rows(actual, self.pools, i)[items]
            else:
                for i, items, data in request_shards(self.pools, seed, idx):
                    item_rows(expected, self.pools, i)[items] = data
        return ArenaCheck(*compare(self.pools, expected))
