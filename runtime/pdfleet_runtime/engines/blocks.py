"""Block arrays and the vectorized checks every adapter runs before an engine sees a block.

A batch is the planner's ``Blocks``: three equal-length int64 arrays ``(src address, dst address,
length)`` (``checked`` makes sure). ``RegionTable`` refuses any block not
wholly inside one registered region (one ``searchsorted`` for the whole batch; Mooncake once
returned success for a write from an unregistered address without moving a byte).
``GranuleTable`` maps blocks made of whole items of a buffer to item indices, the addressing of
NIXL's prepared descriptor lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdfleet_runtime.engines.errors import BlockError, BlockRangeError, Side
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import BufferRecord, RegionRecord

__all__ = ["Granule", "GranuleTable", "RegionTable", "checked", "granules_of"]

_MAX_ADDR = np.iinfo(np.int64).max


def _as_int64(values: object, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype.kind == "u":
        if arr.size and int(arr.max()) > _MAX_ADDR:
            raise BlockError(f"{name} holds values above 2**63 - 1")
        return arr.astype(np.int64)
    if arr.dtype.kind not in "i" and arr.size:
        raise BlockError(f"{name} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def checked(blocks: Blocks) -> Blocks:
    """``blocks`` with int64 arrays of one length, every length positive and every address non-negative;
    ``BlockError`` otherwise (what every adapter runs before an engine sees a block)."""
    if not isinstance(blocks, Blocks):
        raise BlockError(f"engines take planner Blocks, got {type(blocks).__name__}")
    src, dst, length = (_as_int64(p, n) for p, n in zip((blocks.src, blocks.dst, blocks.length),
                                                         ("src", "dst", "length"), strict=True))
    if not (src.size == dst.size == length.size):
        raise BlockError(f"block arrays differ in length: src {src.size}, dst {dst.size}, length {length.size}")
    if length.size:
        bad = np.flatnonzero((length <= 0) | (src < 0) | (dst < 0))
        if bad.size:
            raise BlockError(f"{bad.size} block(s) with a non-positive length or negative address, "
                             f"first indices {bad[:8].tolist()}")
    if src is blocks.src and dst is blocks.dst and length is blocks.length:
        return blocks
    return Blocks(src, dst, length, blocks.state)


class RegionTable:
    """Registered regions of one side, sorted, for one-shot range checks of a whole batch."""

    def __init__(self, regions: Sequence[RegionRecord], side: Side) -> None:
        order = sorted(regions, key=lambda r: r.address)
        self.side = side
        self.regions: tuple[RegionRecord, ...] = tuple(order)
        self.bases = np.array([r.address for r in order], dtype=np.int64)
        self.ends = self.bases + np.array([r.total_bytes for r in order], dtype=np.int64)
        if any(r.total_bytes <= 0 for r in order):
            raise BlockError(f"{side.value} regions must have a positive size")
        if self.bases.size > 1 and (self.ends[:-1] > self.bases[1:]).any():
            raise BlockError(f"{side.value} regions overlap")

    def check(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Region index of every block; raises ``BlockRangeError`` if any block leaves its region."""
        if not addr.size:
            return np.zeros(0, dtype=np.int64)
        if not self.bases.size:
            raise BlockRangeError(self.side, int(addr.size), range(min(8, addr.size)), "nothing is registered")
        region = np.searchsorted(self.bases, addr, side="right") - 1
        clipped = np.maximum(region, 0)
        bad = (region < 0) | (addr + length > self.ends[clipped])
        if bad.any():
            idx = np.flatnonzero(bad)
            i = int(idx[0])
            raise BlockRangeError(self.side, int(idx.size), idx[:8],
                                  f"block {i} at {int(addr[i]):#x} + {int(length[i])} bytes")
        return region


@dataclass(frozen=True)
class Granule:
    """``count`` items of ``item_bytes`` at ``address``: one buffer, the unit of prepared descriptors."""

    address: int
    item_bytes: int
    count: int


def granules_of(buffers: Sequence[BufferRecord]) -> tuple[Granule, ...]:
    """One granule per buffer record (pools' buffers are disjoint, so granules are too)."""
    return tuple(Granule(b.address, b.item_bytes, b.count) for b in buffers if b.count > 0)


class GranuleTable:
    """Item indices of a side's granules, in address order: descriptor ``i`` is one whole item."""

    def __init__(self, granules: Sequence[Granule]) -> None:
        order = sorted(granules, key=lambda g: g.address)
        self.base = np.array([g.address for g in order], dtype=np.int64)
        self.item = np.array([g.item_bytes for g in order], dtype=np.int64)
        self.count = np.array([g.count for g in order], dtype=np.int64)
        self.end = self.base + self.item * self.count
        self.first = np.concatenate(([0], np.cumsum(self.count)[:-1])).astype(np.int64)
        if self.base.size > 1 and (self.end[:-1] > self.base[1:]).any():
            raise BlockError("granules overlap")

    @property
    def size(self) -> int:
        return int(self.count.sum())

    def descriptors(self, device_id: int = 0) -> np.ndarray:
        """Every item as ``(address, length, device)``, uint64 ``(size, 3)``, in index order."""
        n = self.size
        g = np.repeat(np.arange(self.base.size), self.count)
        within = np.arange(n, dtype=np.int64) - np.repeat(self.first, self.count)
        out = np.empty((n, 3), dtype=np.uint64)
        out[:, 0] = self.base[g] + within * self.item[g]
        out[:, 1] = self.item[g]
        out[:, 2] = device_id
        return out

    def locate(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each block: whether it is whole items of one granule, its first item index and item size."""
        if not self.base.size or not addr.size:
            z = np.zeros(addr.size, dtype=np.int64)
            return np.zeros(addr.size, dtype=bool), z, z
        g = np.maximum(np.searchsorted(self.base, addr, side="right") - 1, 0)
        item = self.item[g]
        off = addr - self.base[g]
        ok = (off >= 0) & (addr + length <= self.end[g]) & (off % item == 0) & (length % item == 0)
        return ok, self.first[g] + off // item, item

    @staticmethod
    def expand(first: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Indices ``first[i] .. first[i] + items[i] - 1`` of every block, concatenated (int32 for NIXL)."""
        total = int(items.sum())
        starts = np.repeat(first - (np.cumsum(items) - items), items)
        return (starts + np.arange(total, dtype=np.int64)).astype(np.int32)
