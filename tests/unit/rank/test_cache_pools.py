"""The cache <-> pool mapping (rank.cache_pools), on its own: shares written by one shape and gathered by any
other rebuild the state bit for bit; a wrong share is caught, never silently used."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdfleet_runtime.layouts import AttentionKind, DType, LayerSet, Layout, LinearAttentionConfig, MLAConfig  # noqa: E402
from pdfleet_runtime.model.state import RankShare  # noqa: E402
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator  # noqa: E402
from pdfleet_runtime.rank.cache_pools import ModelState, ShareError, gather_state, read_share, write_share  # noqa: E402
from pdfleet_runtime.records import ParallelShape as S  # noqa: E402

F32 = DType.FLOAT32
HYBRID = Layout(num_layers=4, full_attention_layers=LayerSet(ids=[1, 3]), kv_heads=2, head_dim=4, dtype=F32,
                page_size=4, linear_attention=LinearAttentionConfig(
                    num_key_heads=4, num_value_heads=8, key_head_dim=2, value_head_dim=3, conv_kernel=4,
                    conv_dtype=F32, temporal_dtype=F32))
MLA = Layout(num_layers=3, full_attention_layers=LayerSet(interval=1), attention_kind=AttentionKind.MLA, kv_heads=1,
             mla=MLAConfig(kv_lora_rank=6, qk_rope_head_dim=2), dtype=F32, page_size=4)
SHAPES = [S(1), S(2), S(4), S(1, 2), S(2, 2)]


def random_state(lay: Layout, length: int, seed: int = 0) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    st = ModelState(length)
    for i in lay.full_attention_layer_ids:
        if lay.attention_kind is AttentionKind.MLA:
            assert lay.mla is not None
            st.kv[i] = (torch.randn(length, lay.mla.kv_lora_rank, generator=g),
                        torch.randn(length, lay.mla.qk_rope_head_dim, generator=g))
        else:
            assert lay.head_dim is not None
            st.kv[i] = tuple(torch.randn(lay.kv_heads, length, lay.head_dim, generator=g) for _ in "kv")
    la = lay.linear_attention
    for i in lay.linear_layer_ids:
        assert la is not None
        st.conv[i] = torch.randn(la.conv_kernel - 1, sum(la.conv_shard_groups), generator=g)
        st.recurrent[i] = torch.randn(la.num_value_heads, la.key_head_dim, la.value_head_dim, generator=g)
    return st


def side(lay: Layout, shape: S, seed: int) -> tuple[list[RankPools], RequestAllocator]:
    cap = Capacity(3, 40)
    return [RankPools(lay, shape, t, p, cap) for t, p in shape.coords()], RequestAllocator(lay, cap, seed=seed)


@pytest.mark.parametrize(("lay", "shape"), list(itertools.product([HYBRID, MLA], SHAPES)))
def test_write_then_gather_is_the_state_bit_for_bit(lay: Layout, shape: S) -> None:
    pools, alloc = side(lay, shape, seed=3)
    alloc.allocate(5)  # another request's items stay untouched around this one
    idx = alloc.allocate(11)  # 3 pages, the last part full
    st = random_state(lay, 11)
    for p in pools:
        write_share(p, st, idx)
    back = gather_state(lay, shape, [read_share(p, idx) for p in pools], 11)
    assert back.equal(st)


def test_heads_and_conv_groups_land_where_the_layout_says() -> None:
    pools, alloc = side(HYBRID, S(4), seed=1)
    idx = alloc.allocate(6)
    st = random_state(HYBRID, 6)
    for p in pools:
        write_share(p, st, idx)
    # KV: 2 heads over TP 4, so ranks 0, 1 hold head 0 and ranks 2, 3 head 1; page-major, head-major inside.
    k_buf = next(i for i, r in enumerate(pools[3].records) if r.spec.field.value == "k" and r.spec.layer_id == 1)
    pages = pools[3].tensor(k_buf)[torch.tensor(idx.pages)]
    assert torch.equal(pages[0, 0], st.kv[1][0][1, :4]) and torch.equal(pages[1, 0, :2], st.kv[1][0][1, 4:6])
    # Conv: q, k, v groups of 8, 8, 24 channels; rank 2 holds q[4:6], k[4:6], v[12:18].
    conv = next(i for i, r in enumerate(pools[2].records) if r.spec.field.value == "conv" and r.spec.layer_id == 0)
    held = pools[2].tensor(conv)[int(idx.slot)]
    want = torch.cat([st.conv[0][:, 4:6], st.conv[0][:, 12:14], st.conv[0][:, 28:34]], 1)
    assert torch.equal(held, want)


def test_replicas_that_differ_and_missing_ranks_are_errors() -> None:
    pools, alloc = side(MLA, S(2), seed=2)
    idx = alloc.allocate(7)
    for p in pools:
        write_share(p, random_state(MLA, 7), idx)
    shares = [read_share(p, idx) for p in pools]
    flipped = bytes([shares[1].buffers[0][0] ^ 0xFF]) + shares[1].buffers[0][1:]
    shares[1] = RankShare(1, 0, (flipped, *shares[1].buffers[1:]))
    with pytest.raises(ShareError, match="different copies"):
        gather_state(MLA, S(2), shares, 7)
    with pytest.raises(ShareError, match="missing"):
        gather_state(MLA, S(2), shares[:1], 7)


def test_a_dtype_the_pool_does_not_hold_is_refused() -> None:
    pools, alloc = side(MLA, S(1), seed=2)
    st = random_state(MLA, 3)
    st.kv[0] = (st.kv[0][0].to(torch.bfloat16), st.kv[0][1].to(torch.bfloat16))
    with pytest.raises(ShareError, match="bfloat16"):
        write_share(pools[0], st, alloc.allocate(3))


def test_cache_round_trip_through_a_real_model(tmp_path) -> None:
    pytest.importorskip("transformers")
    from pdfleet_runtime.rank.cache_pools import cache_from_state, state_from_cache
    from pdfleet_runtime.rank.model_runner import ModelRunner
    from tests.verify.tiny_models import make_model

    torch.set_num_threads(1)
    runner = ModelRunner(make_model("qwen3_next", tmp_path / "m"))
    pre = runner.prefill([5, 17, 99, 3, 44])
    cache = cache_from_state(pre.state, runner.model.config, runner.layout)
    again = state_from_cache(cache, runner.layout, 5)
    assert again.equal(pre.state)
    # The unread oldest conv column is zero; the newest K - 1 are the state's.
    conv = cache.layers[0].conv_states[0]
    assert conv.shape[-1] == 4 and not conv[..., 0].any()
    assert np.array_equal(conv[0, :, 1:].T.numpy(), pre.state.conv[0].numpy())
