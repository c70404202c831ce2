"""Layouts: model validation, presets and their documented numbers, per-rank buffers, pool sizing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from pdfleet_runtime import layouts as L
from pdfleet_runtime.ids import PLE_NGRAM_LAYER_ID, QSA_ROPE_LAYER_ID
from pdfleet_runtime.layouts import (
    PRESETS,
    EntryField,
    IndexKind,
    LayerSet,
    Layout,
    LayoutRef,
    ShapeError,
    StateType,
    UnknownPresetError,
    rank_buffers,
    rank_state_bytes,
    resolve_layout,
    stage_layers,
)
from tests.unit.runtime.builders import tiny_hybrid

DOCS = Path(__file__).resolve().parents[3] / "docs" / "layouts.md"


def test_presets_state_types() -> None:
    assert PRESETS["qwen3.8-flash-next"].state_types() == {
        StateType.KV, StateType.MAMBA, StateType.QSA_PENDING, StateType.QSA_COMPRESSED,
        StateType.PLE_SHORT_CONV, StateType.PLE_NGRAM,
    }
    assert PRESETS["qwen3-next-hybrid"].state_types() == {StateType.KV, StateType.MAMBA}
    assert PRESETS["llama-dense"].state_types() == {StateType.KV}
    assert PRESETS["deepseek-mla"].state_types() == {StateType.KV}


def test_qwen_next_layers_one_full_in_four() -> None:
    lay = PRESETS["qwen3.8-flash-next"]
    assert lay.num_layers == 48
    assert lay.full_attention_layer_ids == tuple(range(3, 48, 4))
    assert len(lay.linear_layer_ids) == 36 and not set(lay.linear_layer_ids) & set(lay.full_attention_layer_ids)
    assert lay.linear_heads == 16 and lay.qsa_compress_ratio == 4 and lay.kv_heads == 2


def test_layout_ref_exactly_one_and_camel_case_round_trip() -> None:
    with pytest.raises(ValidationError):
        LayoutRef()
    with pytest.raises(ValidationError):
        LayoutRef(preset="llama-dense", inline=PRESETS["llama-dense"])
    wire = {"inline": PRESETS["qwen3.8-flash-next"].model_dump(by_alias=True, exclude_none=True)}
    assert "fullAttentionLayers" in wire["inline"] and "linearAttention" in wire["inline"]
    assert resolve_layout(LayoutRef.model_validate(wire)) == PRESETS["qwen3.8-flash-next"]
    assert resolve_layout(LayoutRef(preset="deepseek-mla")) is PRESETS["deepseek-mla"]


def test_unknown_preset_names_it_and_lists_known() -> None:
    with pytest.raises(UnknownPresetError) as e:
        resolve_layout(LayoutRef(preset="qwen9"))
    assert e.value.name == "qwen9" and "llama-dense" in e.value.known
    assert "qwen9" in str(e.value) and "deepseek-mla" in str(e.value)


def test_models_forbid_extra_fields_and_are_frozen() -> None:
    with pytest.raises(ValidationError):
        LayerSet(interval=1, every=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        PRESETS["llama-dense"].page_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"page_size": 6}, "multiple of qsa.compressRatio"),
        ({"full_attention_layers": LayerSet(ids=[3, 99])}, "not below numLayers"),
        ({"head_dim": None}, "MHA needs headDim"),
        ({"linear_attention": None}, "have no attention"),
    ],
)
def test_inconsistent_layouts_are_rejected(changes: dict, needle: str) -> None:
    data = {**PRESETS["qwen3.8-flash-next"].model_dump(), **changes}
    with pytest.raises(ValidationError, match=re.escape(needle)):
        Layout(**data)


def test_every_model_field_has_a_description_and_schema_is_not_recursive() -> None:
    models = [L.LayerSet, L.MLAConfig, L.LinearAttentionConfig, L.QSAConfig, L.PLEConfig, L.SWAConfig, L.Layout,
              L.LayoutRef]
    for m in models:
        assert issubclass(m, BaseModel)
        for name, f in m.model_fields.items():
            assert f.description, f"{m.__name__}.{name} has no description"
    schema = json.dumps(LayoutRef.model_json_schema())
    assert '"additionalProperties": true' not in schema


def test_stage_layers_partition_all_layers() -> None:
    for n in (1, 5, 48, 61):
        for pp in range(1, min(n, 4) + 1):
            got = [i for k in range(pp) for i in stage_layers(n, pp, k)]
            assert got == list(range(n))


def test_kv_heads_replicated_when_tp_exceeds_heads() -> None:
    kv = [b for b in rank_buffers(PRESETS["qwen3.8-flash-next"], 8, 1, 5, 0) if b.state_type is StateType.KV]
    assert {b.item_shape for b in kv} == {(1, 64, 256)} and len(kv) == 24
    with pytest.raises(ShapeError, match="kvHeads"):
        rank_buffers(PRESETS["llama-dense"], 3, 1, 0, 0)
    with pytest.raises(ShapeError, match="numKeyHeads"):
        rank_buffers(PRESETS["qwen3-next-hybrid"], 32, 1, 0, 0)


def test_stage_without_qsa_layers_registers_no_qsa_pending() -> None:
    lay = tiny_hybrid(8, interval=8)  # the only full-attention (QSA) layer is 7, in the last of 4 stages
    for pp_rank in range(4):
        states = {(b.state_type, b.layer_id) for b in rank_buffers(lay, 1, 4, 0, pp_rank)}
        has_qsa = any(s is StateType.QSA_PENDING for s, _ in states)
        assert has_qsa == (pp_rank == 3)
        assert ((StateType.QSA_PENDING, QSA_ROPE_LAYER_ID) in states) == (pp_rank == 3)
        # PLE is on every layer, so every stage holds the n-gram history (one elected stage sends it).
        assert (StateType.PLE_NGRAM, PLE_NGRAM_LAYER_ID) in states


def test_conv_state_carries_shard_groups_and_outer_count() -> None:
    conv = next(b for b in rank_buffers(PRESETS["qwen3.8-flash-next"], 4, 1, 1, 0) if b.field is EntryField.CONV)
    assert conv.shard_groups == (2048, 2048, 4096)
    assert conv.item_shape == (3, 2048) and conv.outer_count == 3 and conv.dim == 2048
    assert conv.index is IndexKind.SLOT


def _closed_form_rank_bytes(lay: Layout, tp: int, reqs: int, toks: int) -> int:
    """Per-rank pool bytes for PP 1 from the documented numbers (docs/layouts.md)."""
    pages = -(-toks // lay.page_size) + reqs
    nf = len(lay.full_attention_layer_ids)
    if lay.mla is not None:
        kv = nf * lay.page_size * (lay.mla.kv_lora_rank + lay.mla.qk_rope_head_dim) * 2
    else:
        kv = nf * 2 * max(1, lay.kv_heads // tp) * lay.page_size * lay.head_dim * 2
    total = pages * kv
    if (la := lay.linear_attention) is not None:
        nl = len(lay.linear_layer_ids)
        conv = (la.conv_kernel - 1) * (2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim) * 2
        temporal = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
        total += reqs * nl * (conv + temporal) // tp
    if (q := lay.qsa) is not None:
        total += pages * nf * lay.page_size // q.compress_ratio * q.index_heads * q.index_head_dim * 2
        total += reqs * (nf * q.compress_ratio * q.index_heads * q.index_head_dim * 2 + q.compress_ratio * 4)
    if (p := lay.ple) is not None:
        total += reqs * (len(lay.ple_layer_ids) * (p.short_conv_kernel - 1) * p.short_conv_width * 2 + p.ngram_context * 4)
    return total


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_rank_state_bytes_matches_closed_form(name: str, tp: int) -> None:
    lay = PRESETS[name]
    assert rank_state_bytes(lay, tp, 1, 0, 16, 100_000) == _closed_form_rank_bytes(lay, tp, 16, 100_000)


def test_rank_state_bytes_splits_over_pp_stages() -> None:
    lay = PRESETS["llama-dense"]
    whole = rank_state_bytes(lay, 2, 1, 0, 4, 4096)
    assert sum(rank_state_bytes(lay, 2, 4, k, 4, 4096) for k in range(4)) == whole


def test_docs_table_matches_presets() -> None:
    """docs/layouts.md lists bytes per token and per request slot; they must match the presets."""
    text = DOCS.read_text()
    for name, lay in PRESETS.items():
        row = re.search(rf"^\| `{re.escape(name)}` \| ([\d,]+) \| ([\d,]+) \|$", text, re.M)
        assert row, f"{name} missing from the docs bytes table"
        per_token, per_slot = (int(c.replace(",", "")) for c in row.groups())
        # Per token: page-indexed bytes of one page / page size (tp 1); per slot: everything per request.
        one = _closed_form_rank_bytes(lay, 1, 1, lay.page_size)  # 2 pages + 1 request
        two = _closed_form_rank_bytes(lay, 1, 1, 2 * lay.page_size)  # 3 pages + 1 request
        assert per_token * lay.page_size == two - one
        assert per_slot == one - 2 * (two - one)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 2])
def test_a_requests_bytes_split_by_state_type_sum_to_its_bytes(preset: str, tp: int) -> None:
    """``pdfleet_transfer_state_bytes`` splits a verified transfer by state type with these parts: every state type
    of the layout has its part and the parts sum to the request's bytes (one stage, and two where the layers split)."""
    layout = PRESETS[preset]
    counts = {L.IndexKind.PAGE: 3, L.IndexKind.SWA_PAGE: 2 if layout.swa else 0, L.IndexKind.SLOT: 1, L.IndexKind.ROW: 1}
    for pp in (1, 2) if layout.num_layers % 2 == 0 else (1,):
        parts = L.replica_bytes_by_state(layout, tp, pp, counts)
        assert sum(parts.values()) == L.replica_bytes(layout, tp, pp, counts)
        assert set(parts) >= layout.state_types() and all(n > 0 for n in parts.values()), parts
