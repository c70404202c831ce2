"""Byte parity for the state forms issue 43 added to the schema, and a mutation per form that must break it.

Forms: DSA's packed fp8 index keys with their scales (SGLang's and vLLM's DeepSeek-V3.2), declared conv channel groups (Mamba2 x|B|C; B and C replicated on TP/n_groups ranks, one writer elected),
layers that hold nothing, QSA's RoPE ring with MRoPE positions in int64 and PLE's dilated conv with int64
n-grams (SGLang 0.5.23's form). Each layout goes through the in-process harness (``run_parity``: every
decode byte against the seeded state, the bytes outside the request untouched) for equal and different TP
sizes; each mutation stands for a bug the form invites and must make a case fail.
"""

from __future__ import annotations

import pytest

from pdfleet_runtime import layouts, planner
from pdfleet_runtime.layouts import (
    ConvGroup,
    DType,
    IndexKeysConfig,
    LayerSet,
    Layout,
    LinearAttentionConfig,
    PLEConfig,
    PositionsConfig,
    QSAConfig,
)
from pdfleet_runtime.planner import PlanError
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.verify.parity import run_parity
from pdfleet_runtime.verify.results import ParityConfig

S = ParallelShape

# NemotronH's shape in small: Mamba2 layers 0 and 2 (x: 4 heads x 8, B and C: 1 group x 16), an MLP-only layer 1,
# attention on layer 3.
MAMBA2 = Layout(
    num_layers=4, full_attention_layers=LayerSet(ids=[3]), kv_heads=2, head_dim=16, page_size=16,
    empty_layers=LayerSet(ids=[1]),
    linear_attention=LinearAttentionConfig(
        num_key_heads=1, num_value_heads=4, key_head_dim=8, value_head_dim=16, conv_kernel=4,
        conv_groups=[ConvGroup(heads=4, head_dim=8), ConvGroup(heads=1, head_dim=16), ConvGroup(heads=1, head_dim=16)]))
# Qwen4-Exp as SGLang 0.5.23 keeps it, small.
QWEN4_SGLANG = Layout(
    num_layers=4, full_attention_layers=LayerSet(ids=[3]), kv_heads=2, head_dim=16, page_size=16,
    linear_attention=LinearAttentionConfig(num_key_heads=4, num_value_heads=8, key_head_dim=8, value_head_dim=8,
                                           conv_kernel=4),
    qsa=QSAConfig(compress_ratio=4, index_heads=1, index_head_dim=16, rope_positions=3, rope_dtype=DType.INT64),
    ple=PLEConfig(short_conv_layers=LayerSet(ids=[0, 1]), short_conv_width=32, short_conv_kernel=4,
                  short_conv_dilation=3, ngram_context=2, ngram_dtype=DType.INT64))
# Qwen4-Exp as transformers keeps it, small: raw per-token index keys, request-wide positions [3] int64 per
# token, PLE with n-grams on every PLE layer.
QWEN4_TRANSFORMERS = Layout(
    num_layers=4, full_attention_layers=LayerSet(ids=[1, 3]), kv_heads=2, head_dim=16, page_size=16,
    linear_attention=LinearAttentionConfig(num_key_heads=4, num_value_heads=8, key_head_dim=8, value_head_dim=8,
                                           conv_kernel=4),
    index_keys=IndexKeysConfig(head_dim=16), positions=PositionsConfig(),
    ple=PLEConfig(short_conv_layers=LayerSet(ids=[0, 2]), short_conv_width=32, short_conv_kernel=4,
                  short_conv_dilation=3, ngram_context=2, ngram_dtype=DType.INT64, ngram_per_layer=True))
# DeepSeek-V3.2 as SGLang 0.5.23 and vLLM 0.33.0 keep it, small: MLA plus fp8 index keys with a float32 scale
# per 128 dims, packed per 64-token page (DSATokenToKVPool.index_k_with_scale_buffer), replicated on every rank.
DSA_PACKED = Layout(
    num_layers=3, full_attention_layers=LayerSet(interval=1), attention_kind=layouts.AttentionKind.MLA, kv_heads=1,
    mla=layouts.MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8), page_size=64,
    index_keys=IndexKeysConfig(head_dim=128, dtype=DType.FLOAT8_E4M3FN, scale_block=128))
PAIRS = [(S(1), S(2)), (S(2), S(1)), (S(2), S(4)), (S(4), S(1)), (S(2), S(2))]


def _run(lay: Layout, p: ParallelShape, d: ParallelShape):
    return run_parity(ParityConfig(layout=lay, prefill=p, decode=d, requests=3, tokens=96, seed=5),
                      check_with_matrix=False)


@pytest.mark.parametrize(("p", "d"), PAIRS, ids=[f"tp{p.tp}-tp{d.tp}" for p, d in PAIRS])
@pytest.mark.parametrize("lay", [MAMBA2, QWEN4_SGLANG, QWEN4_TRANSFORMERS, DSA_PACKED],
                         ids=["mamba2", "qwen4-sglang", "qwen4-transformers", "dsa-packed"])
def test_new_forms_are_byte_exact(lay: Layout, p: ParallelShape, d: ParallelShape) -> None:
    result = _run(lay, p, d)
    assert result.ok, result


def test_empty_layers_hold_nothing() -> None:
    bufs = layouts.rank_buffers(MAMBA2, 2, 1, 0, 0)
    assert {int(b.layer_id) for b in bufs} == {0, 2, 3}
    conv = next(b for b in bufs if b.field is layouts.EntryField.CONV)
    assert conv.item_shape == (3, 16 + 16 + 16) and conv.group_heads == (4, 1, 1)  # x/2, B and C whole


def test_mutation_wrong_group_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups sliced as if every one were sharded (B and C cut in halves): a TP 1 -> 2 case fails."""
    real = planner.slice_blocks

    def sharded(**kw):  # type: ignore[no-untyped-def]
        kw.pop("group_heads", None)
        return real(**kw)

    monkeypatch.setattr(planner, "slice_blocks", sharded)
    with pytest.raises(PlanError, match="global dims differ"):
        _run(MAMBA2, S(1), S(2))


def test_mutation_missing_replicated_group_election(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every source replica of B and C writes: the planner's coverage check finds bytes written twice."""
    real = layouts.group_range

    def elect_none(src_item_len, dst_item_len, src_dim, dst_dim, outer_count, src_tp, dst_tp, src_rank, dst_rank,
                   groups, heads):  # type: ignore[no-untyped-def]
        blocks = []
        s_base = d_base = 0
        for g, h in zip(groups, heads, strict=True):
            s0, sn = real(g, h, src_tp, src_rank)
            d0, dn = real(g, h, dst_tp, dst_rank)
            lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
            unit = src_item_len // (outer_count * src_dim)
            for o in range(outer_count):
                if lo < hi:
                    blocks.append((o * src_dim * unit + (s_base + lo - s0) * unit,
                                   o * dst_dim * unit + (d_base + lo - d0) * unit, (hi - lo) * unit))
            s_base += sn
            d_base += dn
        return sorted(blocks)

    monkeypatch.setattr(planner, "_replicable_group_blocks", elect_none)
    with pytest.raises(PlanError, match="written twice"):
        _run(MAMBA2, S(2), S(1))


def test_mutation_dropped_position_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode registers no RoPE position ring (a dropped position buffer): the case fails."""
    real = layouts.rank_buffers

    def drop_rope(lay, tp, pp, tp_rank, pp_rank):  # type: ignore[no-untyped-def]
        out = real(lay, tp, pp, tp_rank, pp_rank)
        if tp == 2:  # the decode side of the TP 1 -> 2 case
            out = tuple(b for b in out if b.field is not layouts.EntryField.ROPE)
        return out

    import pdfleet_runtime.pools as pools

    monkeypatch.setattr(pools, "rank_buffers", drop_rope)
    with pytest.raises(PlanError, match="qsa_pending/rope"):
        _run(QWEN4_SGLANG, S(1), S(2))


def test_pipeline_stages_hold_positions_where_they_hold_index_keys() -> None:
    """Positions are request-wide: each stage holding an index-key layer holds them; one stage sends them."""
    stage0 = {b.state_type for b in layouts.rank_buffers(QWEN4_TRANSFORMERS, 1, 2, 0, 0)}
    assert layouts.StateType.POSITIONS in stage0 and layouts.StateType.INDEX_K in stage0
    for p, d in ((S(1, 2), S(1)), (S(1, 2), S(1, 2)), (S(2, 2), S(1))):
        assert _run(QWEN4_TRANSFORMERS, p, d).ok


def test_mutation_dropped_positions_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode registers no request-wide positions (transformers' indexer_position_ids): the case fails."""
    real = layouts.rank_buffers

    def drop(lay, tp, pp, tp_rank, pp_rank):  # type: ignore[no-untyped-def]
        out = real(lay, tp, pp, tp_rank, pp_rank)
        return tuple(b for b in out if b.field is not layouts.EntryField.POSITIONS) if tp == 2 else out

    import pdfleet_runtime.pools as pools

    monkeypatch.setattr(pools, "rank_buffers", drop)
    with pytest.raises(PlanError, match="positions/positions"):
        _run(QWEN4_TRANSFORMERS, S(1), S(2))


def test_dsa_packed_pages_hold_keys_and_scales() -> None:
    """A packed index page is SGLang's item: 64 tokens x (128 fp8 dims + one float32 scale), as uint8."""
    buf = next(b for b in layouts.rank_buffers(DSA_PACKED, 2, 1, 1, 0) if b.state_type is layouts.StateType.INDEX_K)
    assert (buf.item_shape, buf.dtype, buf.item_bytes) == ((64, 1, 132), DType.UINT8, 64 * 132)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        IndexKeysConfig(head_dim=128, scale_block=128)


def test_mutation_dropped_index_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode sizes its index pages without the scales (raw fp8 keys only): the case fails."""
    real = layouts.rank_buffers

    def no_scales(lay, tp, pp, tp_rank, pp_rank):  # type: ignore[no-untyped-def]
        if tp == 2 and lay.index_keys is not None:
            lay = lay.model_copy(update={"index_keys": IndexKeysConfig(head_dim=128, dtype=DType.FLOAT8_E4M3FN)})
        return real(lay, tp, pp, tp_rank, pp_rank)

    import pdfleet_runtime.pools as pools

    monkeypatch.setattr(pools, "rank_buffers", no_scales)
    with pytest.raises(PlanError, match="index_k"):
        _run(DSA_PACKED, S(1), S(2))
