"""The planner's reference primitives: writer election truth tables, slicing, id pairing, source ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfleet_runtime.planner import (
    Blocks,
    PlanError,
    coalesce,
    head_blocks,
    pair_entries,
    should_send_head,
    should_send_replicated,
    slice_blocks,
    source_ranks,
)
from pdfleet_runtime.records import ParallelShape

# --------------------------------------------------------------------------- election truth tables


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "elected"),
    [(4, 2, [0, 2]), (8, 2, [0, 4]), (8, 1, [0]), (2, 2, [0, 1]), (2, 4, [0, 1]), (1, 8, [0]), (4, 4, [0, 1, 2, 3])],
)
def test_replicated_election_truth_table(src_tp: int, dst_tp: int, elected: list[int]) -> None:
    assert [s for s in range(src_tp) if should_send_replicated(src_tp, dst_tp, s)] == elected


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp", "elected"),
    [
        (2, 8, 4, [0, 2, 4, 6]),
        (2, 8, 1, [0, 4]),
        (2, 8, 2, [0, 4]),
        (8, 8, 2, list(range(8))),  # no replication: every source holds distinct heads
        (4, 8, 2, [0, 2, 4, 6]),
        (2, 4, 8, [0, 1, 2, 3]),  # scatter: every source serves its destinations
    ],
)
def test_kv_head_election_truth_table(heads: int, src_tp: int, dst_tp: int, elected: list[int]) -> None:
    assert [s for s in range(src_tp) if should_send_head(src_tp, dst_tp, s, heads)] == elected


@pytest.mark.parametrize(("src_tp", "dst_tp", "rank"), [(0, 2, 0), (2, 0, 0), (3, 2, 0), (4, 6, 1), (4, 2, 4), (4, 2, -1)])
def test_should_send_replicated_rejects_bad_sizes_and_ranks(src_tp: int, dst_tp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        should_send_replicated(src_tp, dst_tp, rank)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_replicated_aggregation_elects_exactly_one_writer_per_destination(src_tp: int, dst_tp: int) -> None:
    writers: dict[int, int] = {}
    for s in range(src_tp):
        if should_send_replicated(src_tp, dst_tp, s) and src_tp > dst_tp:
            d = s // (src_tp // dst_tp)
            assert d not in writers, f"two writers for dst {d}"
            writers[d] = s
    if src_tp > dst_tp:
        assert sorted(writers) == list(range(dst_tp))


# --------------------------------------------------------------------------- slice_blocks


def test_equal_tp_sharded_is_one_whole_item_block() -> None:
    blocks = slice_blocks(src_item_len=96, dst_item_len=96, src_dim=12, dst_dim=12, outer_count=2,
                          src_tp=2, dst_tp=2, src_rank=1, dst_rank=1, shard_groups=(8, 8, 8))
    assert blocks == [(0, 0, 96)]


def test_scatter_reads_the_destination_slice_of_its_source_per_row() -> None:
    # src tp 1 holds dim 8 (unit 2 bytes) per row, 3 rows; dst tp 4 rank 2 takes units [4, 6).
    blocks = slice_blocks(src_item_len=48, dst_item_len=12, src_dim=8, dst_dim=2, outer_count=3,
                          src_tp=1, dst_tp=4, src_rank=0, dst_rank=2)
    assert blocks == [(8, 0, 4), (24, 4, 4), (40, 8, 4)]


def test_aggregation_writes_whole_source_slice_at_its_offset() -> None:
    # src tp 4 (dim 2), dst tp 2 (dim 4): src rank 3 -> dst rank 1 at units [2, 4).
    blocks = slice_blocks(src_item_len=4, dst_item_len=8, src_dim=2, dst_dim=4, outer_count=1,
                          src_tp=4, dst_tp=2, src_rank=3, dst_rank=1)
    assert blocks == [(0, 4, 4)]


def test_shard_groups_are_sliced_each_on_their_own() -> None:
    # q, k, v of global widths 4, 4, 8; tp 1 -> 2, dst rank 1, unit 1 byte, one row.
    blocks = slice_blocks(src_item_len=16, dst_item_len=8, src_dim=16, dst_dim=8, outer_count=1,
                          src_tp=1, dst_tp=2, src_rank=0, dst_rank=1, shard_groups=(4, 4, 8))
    assert blocks == [(2, 0, 2), (6, 2, 2), (12, 4, 4)]
    # Aggregation: src rank 1 of 2 writes its q, k, v halves into the second half of each group.
    back = slice_blocks(src_item_len=8, dst_item_len=16, src_dim=8, dst_dim=16, outer_count=1,
                        src_tp=2, dst_tp=1, src_rank=1, dst_rank=0, shard_groups=(4, 4, 8))
    assert back == [(0, 2, 2), (2, 6, 2), (4, 12, 4)]


def test_replicated_slices_follow_the_election() -> None:
    kw = {"src_item_len": 10, "dst_item_len": 10, "src_dim": 0, "dst_dim": 0, "outer_count": 1}
    assert slice_blocks(**kw, src_tp=4, dst_tp=2, src_rank=2, dst_rank=1) == [(0, 0, 10)]
    assert slice_blocks(**kw, src_tp=4, dst_tp=2, src_rank=3, dst_rank=1) == []
    assert slice_blocks(**kw, src_tp=2, dst_tp=4, src_rank=1, dst_rank=3) == [(0, 0, 10)]


@pytest.mark.parametrize(
    "kw",
    [
        {"src_dim": 0, "dst_dim": 4},  # replicated on one side only
        {"src_dim": 4, "dst_dim": 0},
        {"src_dim": 0, "dst_dim": 0, "dst_item_len": 12},  # unequal replicated lengths
        {"src_tp": 3},  # sizes do not divide
        {"dst_rank": 1},  # ranks that do not pair (src 0 of 2 serves dst 0 of 2)
        {"src_dim": 4, "dst_dim": 2},  # global dims differ
        {"shard_groups": (3, 5)},  # groups not divisible by tp
    ],
)
def test_slice_blocks_errors(kw: dict) -> None:
    base = {"src_item_len": 8, "dst_item_len": 8, "src_dim": 4, "dst_dim": 4, "outer_count": 1,
            "src_tp": 2, "dst_tp": 2, "src_rank": 0, "dst_rank": 0}
    with pytest.raises(ValueError):
        slice_blocks(**{**base, **kw})


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), st.integers(1, 3),
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_slices_tile_every_destination_exactly_once(src_tp: int, dst_tp: int, outer: int, unit: int,
                                                    group_mult: list[int]) -> None:
    """Over all source ranks, each destination item is written exactly once, from the right source bytes."""
    lcm = max(src_tp, dst_tp)
    groups = tuple(m * lcm for m in group_mult)
    g_dim = sum(groups)
    sd, dd = g_dim // src_tp, g_dim // dst_tp
    for d in range(dst_tp):
        written = [0] * (outer * dd * unit)
        for s in range(src_tp):
            paired = s == d // (dst_tp // src_tp) if src_tp <= dst_tp else d == s // (src_tp // dst_tp)
            if not paired:
                continue
            for so, do, n in slice_blocks(src_item_len=outer * sd * unit, dst_item_len=outer * dd * unit,
                                          src_dim=sd, dst_dim=dd, outer_count=outer, src_tp=src_tp,
                                          dst_tp=dst_tp, src_rank=s, dst_rank=d, shard_groups=groups):
                for k in range(n):
                    written[do + k] += 1
                    # Global coordinate of the source byte must equal that of the destination byte.
                    assert _global(s, so + k, src_tp, groups, unit, sd) == _global(d, do + k, dst_tp, groups, unit, dd)
        assert written == [1] * len(written)


def _global(rank: int, byte: int, tp: int, groups: tuple[int, ...], unit: int, dim: int) -> tuple[int, int, int]:
    row, rest = divmod(byte, dim * unit)
    u, b = divmod(rest, unit)
    start = 0
    for g in groups:
        w = g // tp
        if u < w:
            return (row, start + rank * w + u, b)
        u -= w
        start += g
    raise AssertionError("unit outside groups")


# --------------------------------------------------------------------------- head_blocks


def test_head_blocks_scatter_and_aggregation() -> None:
    # 8 heads, tp 2 -> 4: dst rank 3 takes heads 6, 7 = the second half of src rank 1's heads 4..7.
    assert head_blocks(head_bytes=10, total_heads=8, src_tp=2, dst_tp=4, src_rank=1, dst_rank=3) == [(20, 0, 20)]
    # 2 heads, tp 8 -> 1: src 4 holds head 1 and writes it at head slot 1; src 5 is not elected.
    assert head_blocks(head_bytes=10, total_heads=2, src_tp=8, dst_tp=1, src_rank=4, dst_rank=0) == [(0, 10, 10)]
    assert head_blocks(head_bytes=10, total_heads=2, src_tp=8, dst_tp=1, src_rank=5, dst_rank=0) == []
    # 2 heads, tp 1 -> 8: dst rank 5 holds head 1.
    assert head_blocks(head_bytes=10, total_heads=2, src_tp=1, dst_tp=8, src_rank=0, dst_rank=5) == [(10, 0, 10)]


# --------------------------------------------------------------------------- pair_entries


def test_pair_entries_by_id_not_position() -> None:
    assert pair_entries([7, 3], [3, 5, 7]) == [(0, 2), (1, 0)]


def test_pair_entries_repeated_ids_pair_in_order() -> None:
    assert pair_entries([4, 4, 9], [9, 4, 4]) == [(0, 1), (1, 2), (2, 0)]
    with pytest.raises(ValueError, match="occurrence 2"):
        pair_entries([4, 4], [4])


def test_pair_entries_source_id_missing_on_destination_raises() -> None:
    with pytest.raises(ValueError, match="layer id 5"):
        pair_entries([1, 5], [1, 2])


def test_pair_entries_unpublished_ids() -> None:
    with pytest.raises(ValueError, match="only one side"):
        pair_entries([1, 2], [None, None])
    assert pair_entries([1, 2], [None, None], allow_positional=True) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="equal entry counts"):
        pair_entries([1, 2], [None], allow_positional=True)
    with pytest.raises(ValueError, match="position 1"):
        pair_entries([None, 2], [1, 3], allow_positional=True)


def test_pair_entries_empty_source_pairs_nothing() -> None:
    assert pair_entries([], [1, 2]) == []
    assert pair_entries([], [None]) == []


# --------------------------------------------------------------------------- ranks and coalescing


def test_source_ranks_scatter_aggregation_and_pp() -> None:
    assert source_ranks(ParallelShape(2), ParallelShape(8), 5, 0) == [(1, 0)]
    assert source_ranks(ParallelShape(8), ParallelShape(2), 1, 0) == [(4, 0), (5, 0), (6, 0), (7, 0)]
    assert source_ranks(ParallelShape(4, 2), ParallelShape(2, 1), 0, 0) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert source_ranks(ParallelShape(2, 3), ParallelShape(2, 3), 1, 2) == [(1, 2)]
    with pytest.raises(PlanError, match="pp=2 must equal prefill pp=3 or be 1"):
        source_ranks(ParallelShape(2, 3), ParallelShape(2, 2), 0, 0)
    with pytest.raises(PlanError, match="divide"):
        source_ranks(ParallelShape(3), ParallelShape(2), 0, 0)


def test_coalesce_merges_only_runs_contiguous_on_both_sides_and_of_one_state() -> None:
    import numpy as np

    b = Blocks(np.array([0, 10, 20, 40]), np.array([100, 110, 125, 135]), np.array([10, 10, 10, 5]),
               np.array([0, 0, 0, 1], dtype=np.uint8))
    c = coalesce(b)
    assert c.src.tolist() == [0, 20, 40] and c.length.tolist() == [20, 10, 5]
    assert c.bytes == b.bytes
