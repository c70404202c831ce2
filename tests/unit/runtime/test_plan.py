"""Compiled plans between registrations: coalescing, descriptor counts, sentinels, exactness and coverage errors."""

from __future__ import annotations

import numpy as np
import pytest

from pdfleet_runtime.ids import PLE_NGRAM_LAYER_ID, QSA_ROPE_LAYER_ID, is_sentinel
from pdfleet_runtime.layouts import PRESETS, StateType
from pdfleet_runtime.planner import STATE_ORDER, PlanError, compile_destination, compile_pair, source_ranks
from pdfleet_runtime.records import ParallelShape, RequestIndices, virtual_registration
from tests.unit.runtime.builders import plan_all, tiny_hybrid

QWEN = PRESETS["qwen3.8-flash-next"]
S = ParallelShape


def _reg(layout, shape, t, p, base):
    return virtual_registration(layout, shape, t, p, 4, 4096, base=base)


def _state_blocks(blocks, state: StateType) -> int:
    return int((blocks.state == STATE_ORDER.index(state)).sum())


def test_contiguous_pages_coalesce_to_one_block_per_entry() -> None:
    lay = PRESETS["llama-dense"]
    src, dst = _reg(lay, S(2), 0, 0, 1 << 40), _reg(lay, S(2), 0, 0, 1 << 42)
    plan = compile_pair(src, dst)
    blocks = plan.plan(RequestIndices(np.arange(10, 30), slot=0, row=0), RequestIndices(np.arange(50, 70), slot=1, row=1))
    assert blocks.descriptors == 64  # 32 layers x (K, V), one run each
    assert blocks.bytes == 20 * 64 * 16 * 4 * 128 * 2  # pages x entries x page x heads/rank x dim x bf16


def test_fragmented_pages_break_runs_where_either_side_breaks() -> None:
    lay = PRESETS["llama-dense"]
    plan = compile_pair(_reg(lay, S(1), 0, 0, 1 << 40), _reg(lay, S(1), 0, 0, 1 << 42))
    src = RequestIndices([1, 2, 3, 7, 8], slot=0, row=0)
    dst = RequestIndices([4, 5, 9, 10, 11], slot=0, row=0)
    blocks = plan.plan(src, dst)
    # runs [1, 2]->[4, 5], [3]->[9], [7, 8]->[10, 11]: dst breaks after 5, src after 3
    assert blocks.descriptors == 3 * 64


def test_hetero_tp_kv_is_one_block_per_page_per_entry() -> None:
    out = plan_all(QWEN, S(4), S(2), [32 * 64])  # 32 pages (+ nothing partial)
    kv_entries = 2 * len(QWEN.full_attention_layer_ids)
    per_dst = [sum(_state_blocks(b, StateType.KV) for b in srcs.values()) for srcs in out.values()]
    # tp 4 -> 2 with 2 KV heads: ranks 0 and 2 elected, one source per decode rank writes KV.
    assert per_dst == [32 * kv_entries] * 2


def test_equal_tp_fragmented_kv_descriptors_equal_pages_times_entries_at_most() -> None:
    out = plan_all(QWEN, S(4), S(4), [32 * 64], seed=3)
    kv_entries = 2 * len(QWEN.full_attention_layer_ids)
    for srcs in out.values():
        n = sum(_state_blocks(b, StateType.KV) for b in srcs.values())
        assert 0 < n <= 32 * kv_entries


def test_two_pp_stages_never_both_send_a_sentinel_state() -> None:
    lay = tiny_hybrid(8, interval=2)  # QSA on layers 1, 3, 5, 7 and PLE on all: every stage holds both sentinels
    p, d = S(2, 4), S(2, 1)
    srcs = {(t, k): _reg(lay, p, t, k, (1 << 40) + (p.rank(t, k) << 34)) for t, k in p.coords()}
    for t in range(2):
        held = [r for r in srcs.values() if any(is_sentinel(b.spec.layer_id) for b in r.buffers)]
        assert len({r.pp_rank for r in held}) == 4  # every stage holds them ...
        plan = compile_destination(_reg(lay, d, t, 0, 1 << 46), [srcs[k] for k in source_ranks(p, d, t, 0)])
        for sentinel in (QSA_ROPE_LAYER_ID, PLE_NGRAM_LAYER_ID):
            senders = [pp.src_rank for pp in plan.pairs for a, _, _ in pp.pairs if a.spec.layer_id == sentinel]
            assert senders == [p.rank(t, 0)]  # ... but only the lowest stage sends each
    # With equal PP every decode stage gets the n-gram history from its own prefill stage.
    same = plan_all(lay, S(1, 4), S(1, 4), [9])
    assert all(_state_blocks(next(iter(v.values())), StateType.PLE_NGRAM) == 1 for v in same.values())


def test_sentinel_bytes_pp4_to_pp1_equal_one_copy_per_decode_rank() -> None:
    lay = tiny_hybrid(8, interval=2)
    out = plan_all(lay, S(1, 4), S(1, 1), [9, 5])
    ngram = sum(b.bytes_by_state().get("ple_ngram", 0) for b in out[(0, 0)].values())
    assert ngram == 2 * 3 * 4  # two requests x ngram_context 3 x int32


def test_unequal_index_lists_are_an_error_naming_state_and_layer() -> None:
    plan = compile_pair(_reg(QWEN, S(2), 0, 0, 1 << 40), _reg(QWEN, S(2), 0, 0, 1 << 42))
    with pytest.raises(PlanError) as e:
        plan.plan(RequestIndices([0, 1, 2], slot=0, row=0), RequestIndices([0, 1], slot=0, row=0))
    assert e.value.state_type is StateType.KV and e.value.layer_id == 3
    assert "source 3, destination 2" in str(e.value)
    with pytest.raises(PlanError, match="row index lists differ"):
        plan.plan(RequestIndices([0], slot=0, row=0), RequestIndices([0], slot=0, row=None))


def test_out_of_range_and_repeated_indices_are_named() -> None:
    plan = compile_pair(_reg(QWEN, S(1), 0, 0, 1 << 40), _reg(QWEN, S(1), 0, 0, 1 << 42))
    with pytest.raises(PlanError) as e:
        plan.plan(RequestIndices([0, 1], slot=0, row=0), RequestIndices([5, 100000], slot=0, row=0))
    assert e.value.indices == (100000,) and "destination page indices outside" in str(e.value)
    with pytest.raises(PlanError) as e:
        plan.plan(RequestIndices([0, 1], slot=0, row=0), RequestIndices([5, 5], slot=0, row=0))
    assert e.value.indices == (5,)


def test_destination_layer_without_source_fails_coverage() -> None:
    p, d = S(1, 2), S(1, 1)
    dst = _reg(QWEN, d, 0, 0, 1 << 42)
    only_stage0 = _reg(QWEN, p, 0, 0, 1 << 40)
    with pytest.raises(PlanError, match="must pair with prefill ranks"):
        compile_destination(dst, [only_stage0])
    # Forge a stage-1 registration that lacks its last KV layer: the decode buffer is never written.
    stage1 = _reg(QWEN, p, 0, 1, 1 << 41)
    forged = type(stage1)(stage1.shape, 0, 1, stage1.region,
                          tuple(b for b in stage1.buffers if not (b.spec.state_type is StateType.KV
                                                                  and b.spec.layer_id == 47)))
    with pytest.raises(PlanError) as e:
        compile_destination(dst, [only_stage0, forged])
    assert e.value.state_type is StateType.KV and e.value.layer_id == 47 and "never written" in str(e.value)


def test_positional_pairing_only_without_layer_ids_and_pp1() -> None:
    lay = PRESETS["llama-dense"]
    src = _reg(lay, S(2), 0, 0, 1 << 40)
    mori = type(src)(src.shape, 0, 0, src.region, src.buffers, publishes_layer_ids=False)
    dst = _reg(lay, S(2), 0, 0, 1 << 42)
    idx = RequestIndices([0, 1], slot=0, row=0)
    assert compile_pair(mori, dst).plan(idx, idx).bytes == compile_pair(src, dst).plan(idx, idx).bytes
    p2 = _reg(lay, S(2, 2), 0, 0, 1 << 40)
    mori_pp = type(p2)(p2.shape, 0, 0, p2.region, p2.buffers, publishes_layer_ids=False)
    with pytest.raises(PlanError, match="only one side"):
        compile_pair(mori_pp, _reg(lay, S(2, 1), 0, 0, 1 << 42))


def test_every_source_rank_listed_even_when_not_elected() -> None:
    p, d = S(8), S(2)
    srcs = [_reg(QWEN, p, t, 0, (1 << 40) + (t << 34)) for t in range(8)]
    dst = _reg(QWEN, d, 1, 0, 1 << 46)
    plan = compile_destination(dst, [srcs[t] for t, _ in source_ranks(p, d, 1, 0)])
    assert plan.sources == (4, 5, 6, 7)
    per_src = plan.plan(RequestIndices([0, 1], slot=0, row=0), RequestIndices([2, 3], slot=0, row=0))
    # Only the elected rank 4 writes KV (2 heads, tp 8: heads replicated 4x) and replicated state.
    kv = {r: _state_blocks(b, StateType.KV) for r, b in per_src.items()}
    assert kv == {4: 24, 5: 0, 6: 0, 7: 0}  # pages 0, 1 -> 2, 3 are one run per entry
    assert all(_state_blocks(b, StateType.MAMBA) for b in per_src.values())  # sharded: everyone writes


def test_state_of_two_dtypes_with_equal_item_sizes_is_not_paired() -> None:
    """bfloat16 and float16 have the same item size: bytes would move and the decode compute on them. The pair
    is refused, naming the dtypes (a prefill and a decode of two KV-dtype generations, docs/router.md)."""
    lay = PRESETS["llama-dense"]
    fp16 = lay.model_copy(update={"dtype": lay.dtype.__class__("float16")})
    with pytest.raises(PlanError) as e:
        compile_pair(_reg(lay, S(1), 0, 0, 1 << 40), _reg(fp16, S(1), 0, 0, 1 << 42))
    assert e.value.rule == "dtype-equal" and e.value.state_type is StateType.KV
    assert "bfloat16" in str(e.value) and "float16" in str(e.value)
    compile_pair(_reg(fp16, S(1), 0, 0, 1 << 40), _reg(fp16, S(1), 0, 0, 1 << 42))  # one dtype: planned
