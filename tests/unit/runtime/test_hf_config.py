"""config.json -> layout (pure): every supported family, any size, and a preset named beside a config must agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfleet_runtime.layouts import PRESETS, AttentionKind, DType, UnknownPresetError
from pdfleet_runtime.model.hf_config import (
    MAX_CONFIG_BYTES,
    ModelConfigError,
    layout_for_model,
    layout_from_config,
    read_config,
)

# The published configs' state-shaping fields (Qwen3-Next-80B-A3B, Llama-3-8B, DeepSeek-V3).
QWEN3_NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 48, "full_attention_interval": 4,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4, "hidden_size": 2048, "torch_dtype": "bfloat16"}
LLAMA_3_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "dtype": "bfloat16"}


@pytest.mark.parametrize(("config", "preset"), [(QWEN3_NEXT, "qwen3-next-hybrid"), (LLAMA_3_8B, "llama-dense"),
                                                (DEEPSEEK_V3, "deepseek-mla")])
def test_published_configs_agree_with_their_presets(config: dict, preset: str) -> None:
    assert layout_for_model(config, preset) == PRESETS[preset]
    derived = layout_from_config(config, page_size=PRESETS[preset].page_size)
    assert derived.full_attention_layer_ids == PRESETS[preset].full_attention_layer_ids
    assert derived.state_types() == PRESETS[preset].state_types()


def test_transformers_default_configs_are_the_presets() -> None:
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, Qwen3NextConfig

    for cls, preset in ((Qwen3NextConfig, "qwen3-next-hybrid"), (DeepseekV3Config, "deepseek-mla")):
        cfg = cls().to_dict()
        cfg["dtype"] = "bfloat16"  # the published weights' dtype (a bare config says none: float32)
        assert layout_for_model(cfg, preset) == PRESETS[preset]


def test_qwen3_5_text_reads_layer_types_and_any_size() -> None:
    cfg = {**QWEN3_NEXT, "model_type": "qwen3_5_text", "num_hidden_layers": 3, "dtype": "float32",
           "layer_types": ["linear_attention", "full_attention", "linear_attention"], "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}
    lay = layout_from_config(cfg, page_size=4)
    assert lay.full_attention_layer_ids == (1,) and lay.linear_layer_ids == (0, 2)
    assert lay.dtype is DType.FLOAT32 and lay.page_size == 4
    la = lay.linear_attention
    assert la is not None and la.conv_shard_groups == (16, 16, 32)
    assert la.conv_dtype is DType.FLOAT32 and la.temporal_dtype is DType.FLOAT32


def test_llama_defaults_kv_heads_and_head_dim_as_transformers_does() -> None:
    lay = layout_from_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                              "hidden_size": 64})
    assert (lay.kv_heads, lay.head_dim, lay.dtype) == (4, 16, DType.FLOAT32)
    mla = layout_from_config({**DEEPSEEK_V3, "num_hidden_layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8})
    assert mla.attention_kind is AttentionKind.MLA and mla.kv_entry_dim == 24


@pytest.mark.parametrize(("change", "field"), [
    ({"num_hidden_layers": 47}, "numLayers"),
    ({"num_key_value_heads": 4}, "kvHeads"),
    ({"full_attention_interval": 2}, "fullAttentionLayers"),
    ({"linear_conv_kernel_dim": 5}, "linearAttention.convKernel"),
    ({"torch_dtype": "float32"}, "dtype"),
])
def test_a_preset_that_disagrees_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelConfigError) as e:
        layout_for_model({**QWEN3_NEXT, **change}, "qwen3-next-hybrid")
    assert e.value.field == field and field in str(e.value) and "qwen3-next-hybrid" in str(e.value)


def test_a_preset_with_state_the_model_lacks_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="qsa"):
        layout_for_model(QWEN3_NEXT, "qwen3.8-flash-next")
    with pytest.raises(UnknownPresetError):
        layout_for_model(QWEN3_NEXT, "no-such-preset")


@pytest.mark.parametrize(("config", "field"), [
    ({"model_type": "falcon_h1", "num_hidden_layers": 2}, "model_type"),
    ({"model_type": "mistral", "num_hidden_layers": 2}, "num_attention_heads"),
    ({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 0, "num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
      "hidden_size": 64}, "num_key_value_heads"),
    ({**QWEN3_NEXT, "layer_types": ["full_attention"]}, "layer_types"),
    ({**QWEN3_NEXT, "dtype": "int8"}, "dtype"),
])
def test_bad_configs_name_the_field(config: dict, field: str) -> None:
    with pytest.raises(ModelConfigError) as e:
        layout_from_config(config)
    assert e.value.field == field and field in str(e.value)


def test_read_config_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ModelConfigError, match="bound"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert read_config(tmp_path)["num_key_value_heads"] == 8
