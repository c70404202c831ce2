"""Tiny real models for the token-parity tests: a config per family, weights drawn with init range 0.3 and saved
as safetensors in a directory of the Hugging Face layout (what ``--model DIR`` reads).

With transformers' default init (std 0.02) even a KV-only transfer gives the right tokens; 0.3 makes each
state kind matter (shared/realmodel.md). Heads are chosen so that TP 1, 2 and 4 all divide them (the KV
heads are 2, so TP 4 replicates each KV head on two ranks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen3_next", "qwen3_5_text", "deepseek_v3")
QWEN4 = "qwen4_exp_text"  # transformers' Qwen4-Exp form (tests/verify/test_model_parity_qwen4.py)
NEW_FAMILIES = (QWEN4, "deepseek_v32", "nemotron_h", "mistral")  # their forms came with issue 43
INIT_RANGE = 0.3
_COMMON: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "initializer_range": INIT_RANGE, "dtype": "float32",
                           "max_position_embeddings": 512, "tie_word_embeddings": False}
_GDN = {"num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": 2},
    "qwen3_next": {**_GDN, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    "qwen3_5_text": dict(_GDN),
    "qwen4_exp_text": {**_GDN, "layer_types": ["linear_attention", "indexed_attention", "linear_attention",
                                               "indexed_attention"],
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32, "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1, 3],
                       "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 2, "ple_embed_dim": 64,
                       "ngram_vocab_size_base": 256, "make_ngram_vocab_size_divisible_by": 8, "indexer_n_heads": 2,
                       "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2, "eos_token_id": 1},
    "deepseek_v32": {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8},
    "mistral": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8},
    "nemotron_h": {"num_key_value_heads": 2, "head_dim": 16, "hybrid_override_pattern": "M-M*", "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 256,
                   "mamba_ssm_cache_dtype": "float32", "use_mamba_kernels": False,
                   "eos_token_id": None, "bos_token_id": None},
    "deepseek_v3": {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1},
}


def config_class(family: str) -> Any:
    from transformers import (
        DeepseekV3Config,
        DeepseekV32Config,
        LlamaConfig,
        MistralConfig,
        NemotronHConfig,
        Qwen3NextConfig,
        Qwen4ExpTextConfig,
    )
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return {"llama": LlamaConfig, "qwen3_next": Qwen3NextConfig, "qwen3_5_text": Qwen3_5TextConfig,
            "deepseek_v3": DeepseekV3Config, "qwen4_exp_text": Qwen4ExpTextConfig,
            "deepseek_v32": DeepseekV32Config, "nemotron_h": NemotronHConfig, "mistral": MistralConfig}[family]


def make_model(family: str, directory: Path, *, seed: int = 0, weights: bool = True, **overrides: Any) -> Path:
    """A tiny ``family`` model in ``directory`` (config.json, and model.safetensors unless ``weights`` is False)."""
    import torch
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = config_class(family)(**{**_COMMON, **CONFIGS[family], **overrides})
    if not weights:
        (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        return directory
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
