"""A rank's seeded arena (``rank.arena``, what ``ArenaCheckOp`` runs) and the reservations of ``SeededArenaOp``,
in one process: every byte outside the requests' items is checked, a failed request's items are "don't care"
until a later request succeeds into them, and a reserved request takes the items a seeded allocator gave it."""

from __future__ import annotations

import numpy as np

from pdfleet_runtime.layouts import PRESETS, IndexKind
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.rank.arena import SeededArena
from pdfleet_runtime.rank.requests import SyntheticSource
from pdfleet_runtime.rank.synthetic import corrupt_request, fill_request
from pdfleet_runtime.records import ParallelShape, RequestIndices

LAYOUT = PRESETS["llama-dense"]
CAP = Capacity(3, 96)


def _pools() -> RankPools:
    return RankPools(LAYOUT, ParallelShape(1), 0, 0, CAP, "cpu")


def _outside(pools: RankPools, *reqs: RequestIndices) -> tuple[int, int]:
    """(buffer, item) of an item no request holds."""
    for i, rec in enumerate(pools.records):
        held = set().union(*(set(r.of(rec.spec.index).tolist()) for r in reqs))
        free = [k for k in range(rec.count) if k not in held]
        if free:
            return i, free[0]
    raise AssertionError("every item is held")


def test_a_byte_outside_every_request_is_found_and_failed_items_are_dont_care() -> None:
    pools = _pools()
    alloc = RequestAllocator(LAYOUT, CAP, seed=5)
    arena = SeededArena(pools, seed=3, side=2)
    assert arena.check().mismatched == 0
    ok, failed = alloc.allocate(20), alloc.allocate(30)
    fill_request(pools, 11, ok)
    arena.wrote(ok, 11)
    corrupt_request(pools, failed)  # a failed request's partial write
    arena.dirty(failed)
    assert arena.check().mismatched == 0

    buf, item = _outside(pools, ok, failed)
    pools.byte_view(buf)[item, 0] ^= 0xFF
    check = arena.check()
    assert check.mismatched == 1 and check.first is not None and check.first.item == item


def test_a_request_with_wrong_bytes_and_a_later_success_into_failed_items() -> None:
    pools = _pools()
    alloc = RequestAllocator(LAYOUT, CAP, seed=5)
    arena = SeededArena(pools, seed=3, side=2)
    req = alloc.allocate(40)
    fill_request(pools, 11, req)
    arena.wrote(req, 12)  # the decode expected another request's state
    assert arena.check().mismatched > 0

    pools2 = _pools()
    arena2 = SeededArena(pools2, seed=3, side=2)
    idx = alloc.allocate(10)
    corrupt_request(pools2, idx)
    arena2.dirty(idx)  # failed, given back: its items are reused by the next request
    fill_request(pools2, 21, idx)
    arena2.wrote(idx, 21)
    assert arena2.check().mismatched == 0
    corrupt_request(pools2, idx)  # once a success holds them, the items are checked again
    assert arena2.check().mismatched == 1


def test_background_differs_by_side_and_rank() -> None:
    a, b = _pools(), _pools()
    assert not np.array_equal(SeededArena(a, 3, 1).background, SeededArena(b, 3, 2).background)


def test_reserved_requests_take_the_items_a_seeded_allocator_gives_in_order() -> None:
    pools = _pools()
    source = SyntheticSource(pools, RequestAllocator(LAYOUT, CAP))
    source.reset(RequestAllocator(LAYOUT, CAP, seed=9), (("r0", 30), ("r1", 50)))
    reference = RequestAllocator(LAYOUT, CAP, seed=9)
    want = [reference.allocate(30), reference.allocate(50)]
    got = [source.take("r1", 50), source.take("r0", 30)][::-1]  # arrival order does not matter
    for g, w in zip(got, want, strict=True):
        for kind in IndexKind:
            assert np.array_equal(g.of(kind), w.of(kind)), kind
    source.release("r0")
    source.release("r1")
    assert source.free() == {k.value: n for k, n in RequestAllocator(LAYOUT, CAP).free_counts().items()}
