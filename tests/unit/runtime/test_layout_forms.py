"""``pdfleet layout``: forms per engine, the preset they stand beside, weights, and the CLI (pure: no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.cli import main
from pdfleet_operator.validation import validate_text
from pdfleet_runtime.layouts import PRESETS, DType, IndexKind, LayerSet, item_bytes_by_kind
from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import Engine, engine_form
from pdfleet_runtime.model.weights import PRESET_MODELS, model_parameters, model_weight_bytes

# Qwen4-Exp with the qwen3.8-flash-next preset's sizes: Qwen3-Next-80B's attention and GDN, QSA ratio 4 with
# 128-wide index keys, PLE of width 256 (hc_count 4 x hidden 64) with kernel 4 on every layer, 8 n-gram ids.
QWEN4_PRESET_SIZES = {
    "model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"], "dtype": "bfloat16",
    "text_config": {"hidden_size": 64, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                    "full_attention_interval": 4, "hc_count": 4, "ple_layer_ids": list(range(1, 49)),
                    "ple_conv_kernel_size": 4, "ngram_size": 9, "indexer_n_heads": 4, "indexer_kv_heads": 1,
                    "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
                    "dtype": "bfloat16"}}


def test_sglang_form_of_the_preset_sizes_differs_from_the_preset_only_where_docs_say() -> None:
    """docs/layouts.md, "qwen3.8-flash-next against SGLang 0.5.23": four differences, each with SGLang's line."""
    preset = PRESETS["qwen3.8-flash-next"]
    form = engine_form(model_facts(QWEN4_PRESET_SIZES), Engine.SGLANG, tp=1, page_size=preset.page_size)
    lay = form.layout
    assert lay is not None and lay.qsa is not None and lay.ple is not None
    assert lay.full_attention_layer_ids == preset.full_attention_layer_ids
    assert (lay.qsa.index_heads, lay.qsa.rope_positions, lay.qsa.rope_dtype) == (1, 3, DType.INT64)
    assert (lay.ple.short_conv_dilation, lay.ple.ngram_dtype) == (9, DType.INT64)
    undone = lay.model_copy(update={
        "full_attention_layers": preset.full_attention_layers,
        "qsa": lay.qsa.model_copy(update={"index_heads": 4, "rope_positions": 1, "rope_dtype": DType.INT32}),
        "ple": lay.ple.model_copy(update={"short_conv_layers": LayerSet(interval=1), "short_conv_dilation": 1,
                                          "ngram_dtype": DType.INT32})})
    assert undone == preset
    ours, theirs = item_bytes_by_kind(lay, 1, 1, 0), item_bytes_by_kind(preset, 1, 1, 0)
    assert (ours[IndexKind.PAGE], theirs[IndexKind.PAGE]) == (1_622_016, 1_769_472)
    assert (ours[IndexKind.SLOT], theirs[IndexKind.SLOT]) == (77_930_560, 77_340_704)
    assert (ours[IndexKind.ROW], theirs[IndexKind.ROW]) == (12_384, 49_168)


def test_weights_from_published_configs() -> None:
    assert model_parameters(PRESET_MODELS["llama-dense"]) == 8_030_261_248  # Llama-3-8B, exactly
    assert 79.6e9 < (model_parameters(PRESET_MODELS["qwen3-next-hybrid"]) or 0) < 79.8e9
    assert 670.9e9 < (model_parameters(PRESET_MODELS["deepseek-mla"]) or 0) < 671.1e9
    assert model_weight_bytes(PRESET_MODELS["qwen3-next-hybrid"]) == 2 * 79_674_378_240
    assert model_weight_bytes(QWEN4_PRESET_SIZES) is None  # PLE tables: not modelled


@pytest.mark.parametrize("engine", ["transformers", "sglang==0.5.23"])
def test_layout_yaml_is_a_spec_layout_validate_admits(tmp_path: Path, engine: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_next", **{k: v for k, v in PRESET_MODELS["qwen3-next-hybrid"].items()
                                                              if k != "model_type"}}))
    assert main(["layout", "--config", str(tmp_path), "--engine", engine, "--tp", "2", "-o", "yaml"]) == 0
    layout = yaml.safe_load(capsys.readouterr().out)["layout"]
    assert layout["inline"]["weightBytes"] == 2 * 79_674_378_240
    role = {"replicas": 1, "image": "ghcr.io/pdfleet/runtime:0.1.0"}
    spec = {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "m"},
            "spec": {"model": {"layout": layout}, "transfer": {"backend": "mooncake"},
                     "prefill": {**role, "parallelism": {"tensor": 2}}, "decode": {**role, "parallelism": {"tensor": 2}}}}
    (verdict,) = validate_text(yaml.safe_dump(spec), "layout")
    assert verdict.admitted, verdict.violations
    spec["spec"]["prefill"]["parallelism"]["tensor"] = 1  # type: ignore[index]
    (denied,) = validate_text(yaml.safe_dump(spec), "layout")
    assert [v.rule for v in denied.violations] == ["pool-fits-gpu"]
    assert "prefill weights 148.4 GiB (148.4 GiB / 1)" in denied.violations[0].message


def test_layout_text_json_and_the_forms_the_schema_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN4_PRESET_SIZES))
    assert main(["layout", "--config", str(cfg), "--engine", "sglang==0.5.23"]) == 0
    text = capsys.readouterr().out
    assert "QSATokenToKVPool.qsa_rope_position_buffer" in text and "bytes per request slot" in text
    assert main(["layout", "--config", str(cfg), "--engine", "transformers", "-o", "yaml"]) == 0
    inline = yaml.safe_load(capsys.readouterr().out)["layout"]["inline"]
    assert inline["indexKeys"] == {"headDim": 128} and inline["ple"]["ngramPerLayer"] is True
    assert main(["layout", "--config", str(cfg), "--engine", "vllm==0.33.0", "-o", "yaml"]) == 2
    assert "QSA indexer caches" in capsys.readouterr().err
    assert main(["layout", "--config", str(cfg), "--engine", "transformers", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] is not None and {b["name"] for b in out["buffers"]} >= {
        "DynamicIndexedLayer.indexer_keys", "DynamicIndexedLayer.indexer_position_ids",
        "LinearAttentionLayer.conv_states[1]", "LinearAttentionLayer.conv_states[2]"}
    assert main(["layout", "--config", str(cfg), "--engine", "sglang==0.5.23", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err


@pytest.mark.parametrize("fam", ["qwen4_exp_text", "deepseek_v32", "nemotron_h", "qwen3_next", "mistral"])
def test_transformers_layout_holds_the_cache_per_token_and_per_slot(fam: str) -> None:
    """pdfleet's layout of transformers' form holds what the cache holds: every per-token byte (KV, index keys,
    positions) and every per-request byte, less the conv state's oldest column (never read: K-1 move)."""
    from tests.model.configs import CONFIGS

    facts = model_facts(CONFIGS[fam])
    for tp in (1, 2):
        form = engine_form(facts, Engine.TRANSFORMERS, tp=tp, page_size=16)
        assert form.layout is not None, form.missing
        per_kind = item_bytes_by_kind(form.layout, tp, 1, 0)
        assert per_kind.get(IndexKind.PAGE, 0) + per_kind.get(IndexKind.SWA_PAGE, 0) == 16 * form.bytes_per_token
        conv_column = sum(b.item_bytes // b.shape[1] for b in form.buffers if b.name.endswith("conv_states[0]"))
        assert per_kind.get(IndexKind.SLOT, 0) + per_kind.get(IndexKind.ROW, 0) == form.bytes_per_slot - conv_column
