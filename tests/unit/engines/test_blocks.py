"""Block arrays: the adapters' check of planner ``Blocks``, batch splitting, vectorized range checks and granule
indexing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdfleet_runtime.engines import (
    BlockError,
    BlockRangeError,
    Granule,
    GranuleTable,
    RegionTable,
    Side,
    checked,
)
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord


def test_accepts_planner_blocks_of_any_integer_dtype_as_int64() -> None:
    src, dst, length = np.array([0, 100]), np.array([1000, 2000]), np.array([10, 20])
    planned = Blocks(src, dst, length, np.zeros(2, dtype=np.uint8))
    assert checked(planned) is planned  # already int64: no copy
    for form in (planned, Blocks(src.astype(np.uint64), dst.astype(np.uint32), length.astype(np.int32))):
        b = checked(form)
        assert b.src.dtype == b.dst.dtype == b.length.dtype == np.int64
        assert b.src.tolist() == [0, 100] and b.bytes == 30


@pytest.mark.parametrize(
    "bad",
    [
        Blocks(np.array([0, 1]), np.array([0]), np.array([1, 1])),
        Blocks(np.array([0]), np.array([0]), np.array([0])),
        Blocks(np.array([-5]), np.array([0]), np.array([4])),
        Blocks(np.array([0.5]), np.array([0]), np.array([4])),
        Blocks(np.array([2**63], dtype=np.uint64), np.array([0], dtype=np.uint64), np.array([1], dtype=np.uint64)),
        np.zeros((4, 3), dtype=np.int64),
        (np.array([0]), np.array([0]), np.array([1])),
    ],
)
def test_malformed_blocks_are_refused(bad: object) -> None:
    with pytest.raises(BlockError):
        checked(bad)  # type: ignore[arg-type]


def test_chunks_cover_everything_in_order_within_the_limit() -> None:
    n = 10_000
    b = Blocks(np.arange(n), np.arange(n) + n, np.ones(n, dtype=np.int64))
    parts = list(b.chunks(1024))
    assert [p.descriptors for p in parts] == [1024] * 9 + [784]
    assert np.concatenate([p.src for p in parts]).tolist() == b.src.tolist()
    with pytest.raises(ValueError):
        list(b.chunks(0))


def _table() -> RegionTable:
    return RegionTable([RegionRecord(10_000, 1000, "cpu"), RegionRecord(0, 1000, "cpu")], Side.REMOTE)


def test_range_check_finds_regions_and_refuses_every_way_out() -> None:
    t = _table()
    assert t.check(np.array([0, 999, 10_000, 10_500]), np.array([1000, 1, 1000, 10])).tolist() == [0, 0, 1, 1]
    cases = {
        "crosses the end": (np.array([0, 990]), np.array([10, 11])),
        "between regions": (np.array([0, 5000]), np.array([10, 1])),
        "before the first": (np.array([0, -1]), np.array([10, 1])),
        "after the last": (np.array([0, 11_000]), np.array([10, 1])),
    }
    for what, (addr, length) in cases.items():
        with pytest.raises(BlockRangeError) as info:
            t.check(addr, length)
        assert info.value.side is Side.REMOTE and info.value.first == (1,) and info.value.count == 1, what


def test_range_check_reports_count_and_first_indices() -> None:
    addr = np.arange(20) * 100 + 950  # 950 + 60 crosses the first region's end; the rest fall between regions
    with pytest.raises(BlockRangeError) as info:
        _table().check(addr, np.full(20, 60))
    assert info.value.count == 20 and info.value.first == tuple(range(8))


def test_overlapping_regions_are_refused() -> None:
    with pytest.raises(BlockError, match="overlap"):
        RegionTable([RegionRecord(0, 100, "cpu"), RegionRecord(50, 100, "cpu")], Side.LOCAL)


def test_range_check_is_vectorized() -> None:
    n = 1_000_000
    rng = np.random.default_rng(0)
    t = RegionTable([RegionRecord(i * (1 << 30), 1 << 29, "cpu") for i in range(8)], Side.LOCAL)
    addr = rng.integers(0, 8, n) * (1 << 30) + rng.integers(0, 1 << 28, n)
    t0 = time.perf_counter()
    t.check(addr, np.full(n, 4096))
    assert time.perf_counter() - t0 < 1.0  # a Python loop over a million blocks takes seconds


def test_granules_map_whole_items_to_indices() -> None:
    g = GranuleTable([Granule(10_000, 100, 5), Granule(0, 64, 4)])  # index 0..3 at 0, 4..8 at 10_000
    assert g.size == 9
    d = g.descriptors()
    assert d[:, 0].tolist() == [0, 64, 128, 192, 10_000, 10_100, 10_200, 10_300, 10_400]
    ok, first, item = g.locate(np.array([64, 10_100, 10_050, 0, 10_400]), np.array([128, 300, 100, 32, 200]))
    assert ok.tolist() == [True, True, False, False, False]  # misaligned, partial item, past the end
    assert first[:2].tolist() == [1, 5] and item[:2].tolist() == [64, 100]
    assert GranuleTable.expand(first[:2], np.array([2, 3])).tolist() == [1, 2, 5, 6, 7]
