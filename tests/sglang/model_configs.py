"""Tiny ``config.json`` files of each layout preset's real model family, for SGLang's start-up checks.

SGLang picks its model-specific checks by ``architectures`` and ``model_type`` (read through its own
config classes), so the directory must name the real family; the sizes come from the pdfleet layout
(layers, KV heads, head dim, MLA ranks, linear-attention heads) and the rest is small. No weights: the
check adds ``--load-format dummy``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdfleet_runtime.engine_rules.sglang import MODEL_FAMILIES
from pdfleet_runtime.layouts import AttentionKind, resolve_layout


def config_for(preset: str) -> dict:
    fam = MODEL_FAMILIES[preset]
    lay = resolve_layout(preset)
    base = {
        "hidden_size": 1024, "intermediate_size": 2048, "vocab_size": 4096, "num_hidden_layers": lay.num_layers,
        "num_attention_heads": 16, "num_key_value_heads": lay.kv_heads, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }
    if lay.attention_kind is AttentionKind.MLA:
        assert lay.mla is not None
        base.update(kv_lora_rank=lay.mla.kv_lora_rank, qk_rope_head_dim=lay.mla.qk_rope_head_dim,
                    q_lora_rank=256, qk_nope_head_dim=64, v_head_dim=64, num_key_value_heads=16,
                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256,
                    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    else:
        base["head_dim"] = lay.head_dim
    la = lay.linear_attention
    if la is not None:
        base.update(linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads,
                    linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                    linear_conv_kernel_dim=la.conv_kernel, full_attention_interval=4,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256, decoder_sparse_step=1, partial_rotary_factor=0.25)
    if fam.nested_text_config:
        return {"architectures": [fam.architecture], "model_type": fam.model_type, "torch_dtype": "bfloat16",
                "text_config": {"model_type": f"{fam.model_type}_text", **base}}
    return {"architectures": [fam.architecture], "model_type": fam.model_type, **base}


def write_model_dirs(root: Path) -> dict[str, Path]:
    """preset -> a directory holding its config.json."""
    out = {}
    for preset in MODEL_FAMILIES:
        d = root / preset
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config_for(preset), indent=1))
        out[preset] = d
    return out
