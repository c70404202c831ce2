"""The model's ``config.json`` against the declared layout (pure): what the agent refuses readiness for.

SGLang sizes its KV and state pools from ``config.json``; pdfleet plans transfers from
``spec.model.layout``. When the two disagree, every transfer moves the wrong bytes, so the agent reads
the file from the model path it shares with the engine and names each field that contradicts the
layout: layer count and per-layer types, KV heads and head width (MLA: its ranks), linear-attention
heads and widths, the sliding window, and the state types the file implies.

``config_for_layout`` writes the smallest file that agrees with a layout (the stand-in's model
directory and the SGLang start-up checks use it); the sizes SGLang needs beyond the layout are small.
"""

from __future__ import annotations

from typing import Any

from pdfleet_runtime.layouts import AttentionKind, Layout, StateType

__all__ = ["config_for_layout", "layer_types", "model_config_problems"]

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def layer_types(lay: Layout) -> list[str]:
    """Each layer's kind as Hugging Face's ``layer_types`` names it."""
    swa, linear = set(lay.swa_layer_ids), set(lay.linear_layer_ids)
    return [SLIDING if i in swa else LINEAR if i in linear else FULL for i in range(lay.num_layers)]


def config_for_layout(lay: Layout, architecture: str, model_type: str, *, nested_text_config: bool = False) -> dict:
    """A ``config.json`` that agrees with ``lay`` (no weights: SGLang runs it with ``--load-format dummy``)."""
    base: dict[str, Any] = {
        "hidden_size": 1024, "intermediate_size": 2048, "vocab_size": 4096, "num_hidden_layers": lay.num_layers,
        "num_attention_heads": 16, "num_key_value_heads": lay.kv_heads, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "layer_types": layer_types(lay),
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
    if lay.swa is not None:
        base["sliding_window"] = lay.swa.window
    if nested_text_config:
        return {"architectures": [architecture], "model_type": model_type, "torch_dtype": "bfloat16",
                "text_config": {"model_type": f"{model_type}_text", **base}}
    return {"architectures": [architecture], "model_type": model_type, **base}


def _declared_types(cfg: dict) -> list[str] | None:
    """The file's per-layer kinds: ``layer_types``, else Qwen3-Next's ``full_attention_interval``."""
    if isinstance(cfg.get("layer_types"), list):
        return [str(t) for t in cfg["layer_types"]]
    n, every = cfg.get("num_hidden_layers"), cfg.get("full_attention_interval")
    if isinstance(n, int) and isinstance(every, int) and every > 0:
        return [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    return None


def _states_of(cfg: dict, types: list[str] | None) -> set[str]:
    kinds = set(types or [FULL])
    out = {str(StateType.KV)} if FULL in kinds else set()
    if SLIDING in kinds or (types is None and cfg.get("sliding_window")):
        out.add(str(StateType.SWA))
    if LINEAR in kinds or "linear_num_value_heads" in cfg:
        out.add(str(StateType.MAMBA))
    return out


def model_config_problems(config: dict, lay: Layout) -> list[str]:
    """Each field of ``config`` (a parsed config.json) that contradicts ``lay``, as a sentence; [] when none."""
    text = config.get("text_config")
    cfg: dict = text if isinstance(text, dict) else config
    out: list[str] = []

    def want(field: str, expected: object, what: str) -> None:
        got = cfg.get(field)
        if got != expected:
            out.append(f"config.json {field} = {got!r}, the layout declares {expected!r} ({what})")

    want("num_hidden_layers", lay.num_layers, "numLayers")
    types = _declared_types(cfg)
    expected_types = layer_types(lay)
    if types is not None and types != expected_types:
        diff = [i for i in range(max(len(types), len(expected_types)))
                if (types[i] if i < len(types) else None) != (expected_types[i] if i < len(expected_types) else None)]
        i = diff[0]
        out.append(f"config.json layer_types differ from the layout at {len(diff)} layers, first layer {i}: "
                   f"{types[i] if i < len(types) else None!r} in the file, "
                   f"{expected_types[i] if i < len(expected_types) else None!r} in the layout")
    if lay.attention_kind is AttentionKind.MLA:
        assert lay.mla is not None
        want("kv_lora_rank", lay.mla.kv_lora_rank, "mla.kvLoraRank")
        want("qk_rope_head_dim", lay.mla.qk_rope_head_dim, "mla.qkRopeHeadDim")
    else:
        want("num_key_value_heads", lay.kv_heads, "kvHeads")
        if "head_dim" in cfg:
            want("head_dim", lay.head_dim, "headDim")
    la = lay.linear_attention
    if la is not None and lay.linear_layer_ids:
        want("linear_num_key_heads", la.num_key_heads, "linearAttention.numKeyHeads")
        want("linear_num_value_heads", la.num_value_heads, "linearAttention.numValueHeads")
        want("linear_key_head_dim", la.key_head_dim, "linearAttention.keyHeadDim")
        want("linear_value_head_dim", la.value_head_dim, "linearAttention.valueHeadDim")
        want("linear_conv_kernel_dim", la.conv_kernel, "linearAttention.convKernel")
    if lay.swa is not None:
        want("sliding_window", lay.swa.window, "swa.window")
    declared = {str(s) for s in lay.state_types()} & {str(StateType.KV), str(StateType.SWA), str(StateType.MAMBA)}
    implied = _states_of(cfg, types)
    if implied != declared:
        out.append(f"config.json implies state types {sorted(implied)}, the layout declares {sorted(declared)} "
                   "(of kv, swa, mamba)")
    return out
