"""Buffer pools and allocators: arena layout, registration records, typed views, fragmented allocation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pdfleet_runtime.layouts import PRESETS, IndexKind, StateType, rank_state_bytes
from pdfleet_runtime.pools import ALIGN, Capacity, IndexAllocator, PoolExhausted, RankPools, RequestAllocator
from pdfleet_runtime.records import ParallelShape
from tests.unit.runtime.builders import tiny_hybrid


def test_records_lie_in_the_arena_aligned_and_disjoint() -> None:
    pools = RankPools(tiny_hybrid(8), ParallelShape(2, 2), 1, 1, Capacity(3, 50))
    reg = pools.registration()
    assert reg.region.address == pools.arena.data_ptr() and reg.region.total_bytes == pools.arena.numel()
    spans = sorted((r.address, r.address + r.total_bytes) for r in reg.buffers)
    for (_, a1), (b0, _) in itertools.pairwise(spans):
        assert a1 <= b0
    assert all((r.address - reg.region.address) % ALIGN == 0 for r in reg.buffers)
    assert spans[-1][1] <= reg.region.address + reg.region.total_bytes
    assert reg.rank == 3


def test_arena_holds_what_rank_state_bytes_promises() -> None:
    lay = PRESETS["qwen3.8-flash-next"]
    pools = RankPools(lay, ParallelShape(4, 2), 0, 1, Capacity(2, 256))
    need = rank_state_bytes(lay, 4, 2, 1, 2, 256)
    assert need == sum(r.total_bytes for r in pools.records)
    assert need <= pools.arena.numel() < need + ALIGN * len(pools.records)


def test_typed_views_share_the_arena() -> None:
    pools = RankPools(tiny_hybrid(4), ParallelShape(1), 0, 0, Capacity(2, 16))
    i = next(k for k, r in enumerate(pools.records) if r.spec.state_type is StateType.MAMBA)
    t = pools.tensor(i)
    assert t.dtype in (torch.bfloat16, torch.float32) and t.shape[0] == pools.records[i].count
    t[1].fill_(1.0)
    assert pools.byte_view(i)[1].any() and not pools.byte_view(i)[0].any()


def test_fragmented_allocation_is_seeded_and_frees() -> None:
    a = IndexAllocator(IndexKind.PAGE, 100, np.random.default_rng(1))
    ids = a.alloc(30)
    assert len(set(ids.tolist())) == 30 and a.free_count == 70
    assert np.any(np.diff(ids) != 1)  # fragmented
    assert ids.tolist() == IndexAllocator(IndexKind.PAGE, 100, np.random.default_rng(1)).alloc(30).tolist()
    with pytest.raises(PoolExhausted, match="page: asked for 71"):
        a.alloc(71)
    a.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(ids[:2])
    assert a.free_count == 100


def test_request_allocator_gives_pages_slot_and_row() -> None:
    lay = tiny_hybrid(8, page_size=4)
    alloc = RequestAllocator(lay, Capacity(2, 20), seed=3)
    r1, r2 = alloc.allocate(9), alloc.allocate(11)
    assert r1.pages.size == 3 and r2.pages.size == 3 and r1.slot != r2.slot and r1.row != r2.row
    assert not set(r1.pages.tolist()) & set(r2.pages.tolist())
    with pytest.raises(PoolExhausted):
        alloc.allocate(1)  # slots exhausted
    alloc.free(r1)
    assert alloc.allocate(1).slot == r1.slot
