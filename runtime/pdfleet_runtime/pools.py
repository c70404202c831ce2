"""Buffer pools on torch tensors and the per-request allocators.

Each rank allocates one arena (a uint8 tensor on ``cpu`` or ``cuda``, chosen at start) and
carves every buffer of ``layouts.rank_buffers`` out of it, 256-byte aligned. The arena is the
one region a backend registers; each buffer becomes a ``BufferRecord`` with its address.

Indices are per instance, not per rank: all ranks of one prefill (or decode) instance use the
same page, slot and row ids for a request, so ``RequestAllocator`` is separate from the pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdfleet_runtime.ids import RowId, SlotId
from pdfleet_runtime.layouts import (
    BufferSpec,
    DType,
    IndexKind,
    Layout,
    arena_offsets,
    pages_for_tokens,
    pool_counts,
    rank_buffers,
    swa_pages_for_tokens,
)
from pdfleet_runtime.records import (
    BufferRecord,
    ParallelShape,
    RankRegistration,
    RegionRecord,
    RequestIndices,
)

__all__ = ["ALIGN", "Capacity", "IndexAllocator", "PoolExhausted", "RankPools", "RequestAllocator", "torch_dtype"]

ALIGN = 256
"""Byte alignment of every buffer in an arena (enough for any dtype and for engine DMA)."""


class PoolExhausted(RuntimeError):
    """A request asked for more items than are free."""


@dataclass(frozen=True)
class Capacity:
    """What pools are sized for: ``max_requests`` in flight holding ``max_tokens`` tokens in all."""

    max_requests: int
    max_tokens: int

    def counts(self, layout: Layout) -> dict[IndexKind, int]:
        return pool_counts(layout, self.max_requests, self.max_tokens)


def torch_dtype(dtype: DType) -> torch.dtype:
    return getattr(torch, dtype.value)


class RankPools:
    """Every buffer one rank holds, in one arena, with its registration records."""

    def __init__(
        self,
        layout: Layout,
        shape: ParallelShape,
        tp_rank: int,
        pp_rank: int,
        capacity: Capacity,
        device: str | torch.device = "cpu",
    ) -> None:
        self.layout, self.shape, self.tp_rank, self.pp_rank = layout, shape, tp_rank, pp_rank
        self.capacity = capacity
        counts = capacity.counts(layout)
        specs = rank_buffers(layout, shape.tp, shape.pp, tp_rank, pp_rank)
        offsets, total = arena_offsets((counts[s.index] * s.item_bytes for s in specs), ALIGN)
        self.arena = torch.zeros(max(total, ALIGN), dtype=torch.uint8, device=device)
        base = self.arena.data_ptr()
        self._bytes: list[torch.Tensor] = []
        records = []
        for spec, off in zip(specs, offsets, strict=True):
            n = counts[spec.index]
            self._bytes.append(self.arena[off : off + n * spec.item_bytes].view(n, spec.item_bytes))
            records.append(BufferRecord(spec, base + off, n))
        self.records: tuple[BufferRecord, ...] = tuple(records)
        self.region = RegionRecord(base, self.arena.numel(), str(self.arena.device))

    def registration(self, *, publishes_layer_ids: bool = True) -> RankRegistration:
        return RankRegistration(self.shape, self.tp_rank, self.pp_rank, self.region, self.records,
                                publishes_layer_ids)

    def byte_view(self, i: int) -> torch.Tensor:
        """Buffer ``i`` as uint8 ``[count, item_bytes]`` (a view of the arena)."""
        return self._bytes[i]

    def tensor(self, i: int) -> torch.Tensor:
        """Buffer ``i`` with its dtype and shape ``[count, *item_shape]`` (a view of the arena)."""
        spec: BufferSpec = self.records[i].spec
        return self._bytes[i].view(torch_dtype(spec.dtype)).view(self.records[i].count, *spec.item_shape)

    def __len__(self) -> int:
        return len(self.records)


class IndexAllocator:
    """Free list of one index kind. With an ``rng`` it hands out random free items (fragmented)."""

    def __init__(self, kind: IndexKind, count: int, rng: np.random.Generator | None = None) -> None:
        self.kind, self.count, self._rng = kind, count, rng
        self._free = np.ones(count, dtype=bool)

    @property
    def free_count(self) -> int:
        return int(self._free.sum())

    def alloc(self, n: int) -> np.ndarray:
        free = np.flatnonzero(self._free)
        if n > free.size:
            raise PoolExhausted(f"{self.kind.value}: asked for {n}, {free.size} of {self.count} free")
        ids = self._rng.choice(free, size=n, replace=False) if self._rng is not None else free[:n]
        self._free[ids] = False
        return ids.astype(np.int64)

    def free(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (self._free[ids].any() or np.unique(ids).size != ids.size):
            raise ValueError(f"{self.kind.value}: freeing items that are not allocated: {ids[self._free[ids]][:8]}")
        self._free[ids] = True


class RequestAllocator:
    """Allocates a request's pages, SWA pages, slot and row on one instance."""

    def __init__(self, layout: Layout, capacity: Capacity, *, seed: int | None = None) -> None:
        self.layout = layout
        rng = np.random.default_rng(seed) if seed is not None else None
        counts = capacity.counts(layout)
        self._alloc = {k: IndexAllocator(k, counts[k], rng) for k in IndexKind}

    def allocate(self, tokens: int) -> RequestIndices:
        lay = self.layout
        pages = self._alloc[IndexKind.PAGE].alloc(pages_for_tokens(tokens, lay.page_size))
        swa = self._alloc[IndexKind.SWA_PAGE].alloc(
            swa_pages_for_tokens(tokens, lay.swa.window, lay.page_size) if lay.swa else 0
        )
        slot = SlotId(int(self._alloc[IndexKind.SLOT].alloc(1)[0]))
        row = RowId(int(self._alloc[IndexKind.ROW].alloc(1)[0]))
        return RequestIndices(pages, swa, slot, row)

    def free(self, idx: RequestIndices) -> None:
        for kind in IndexKind:
            self._alloc[kind].free(idx.of(kind))

    def free_counts(self) -> dict[IndexKind, int]:
        """Free items per index kind (leak checks in tests and the server's pool gauges)."""
        return {k: a.free_count for k, a in self._alloc.items()}
