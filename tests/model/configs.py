"""Small config.json of every family in docs/layouts.md, with the fields each engine reads (no weights)."""

from __future__ import annotations

from typing import Any

_QWEN_NEXT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "dtype": "bfloat16", "eos_token_id": 1}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "dtype": "bfloat16"},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 8, "dtype": "bfloat16"},
    "qwen3_next": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], **_QWEN_NEXT},
    "qwen3_5_text": {"model_type": "qwen3_5_text", **_QWEN_NEXT,
                     "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                     + ["full_attention"]},
    "qwen4_exp_text": {"model_type": "qwen4_exp_text", **_QWEN_NEXT, "hc_count": 2, "hc_lowrank": 8,
                       "ple_layer_ids": [1, 2, 5], "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 2,
                       "ple_embed_dim": 64, "ngram_vocab_size_base": 256, "make_ngram_vocab_size_divisible_by": 8,
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 1024,
                       "indexer_compress_ratio": 2},
    "deepseek_v3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                    "intermediate_size": 128, "moe_intermediate_size": 32, "vocab_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "dtype": "bfloat16"},
    "deepseek_v32": {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 64,
                     "intermediate_size": 128, "moe_intermediate_size": 32, "vocab_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                     "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1, "index_head_dim": 128, "index_n_heads": 2, "index_topk": 8, "dtype": "bfloat16"},
    "nemotron_h": {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
                   "intermediate_size": 128, "vocab_size": 256, "hybrid_override_pattern": "M-M*", "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4, "expand": 2,
                   "mamba_ssm_cache_dtype": "float32", "dtype": "bfloat16"},
}
