"""A model's weight bytes from its config.json (pure: stdlib only), for the GPU-memory fit check.

Parameters are counted from the sizes that shape them (embeddings, attention or MLA projections, GDN
projections, dense MLP or MoE experts, norms), times the bytes of the weights' dtype: the config's
``dtype``, or one byte for the linear layers of an FP8 checkpoint (``quantization_config.quant_method:
fp8``, DeepSeek-V3's published form). Checked against the published totals: Llama-3-8B 8,030,261,248
parameters exactly, Qwen3-Next-80B-A3B about 79.7B, DeepSeek-V3 about 671B (tests/unit/runtime/test_weights.py).
Families whose parameter count is not modelled (Qwen4-Exp's PLE tables, NemotronH) give None: the fit check
then counts the pools alone.

A rank holds ``weight_bytes / (tp x pp)``: every matrix sharded by TP and the layers split by PP. Norms,
routers and embeddings replicated across TP are a fraction of a percent of these models, left out of the
split.

``PRESET_MODELS``: the published configs (weight-shaping fields) of the real models the presets stand for.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pdfleet_runtime.model.families import text_config
from pdfleet_runtime.model.hf_config import config_dtype

__all__ = ["PRESET_MODELS", "PRESET_WEIGHT_BYTES", "model_parameters", "model_weight_bytes", "rank_weight_bytes"]


def _get(cfg: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    v = cfg.get(name, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _mlp(h: int, inter: int) -> int:
    return 3 * h * inter


def _moe(cfg: Mapping[str, Any], h: int, experts_key: str) -> int | None:
    e, mi = _get(cfg, experts_key), _get(cfg, "moe_intermediate_size")
    if not e or not mi:
        return None
    shared = _get(cfg, "shared_expert_intermediate_size")
    n_shared = _get(cfg, "n_shared_experts", 0) or 0
    out = e * _mlp(h, mi) + h * e
    if shared:
        out += _mlp(h, shared) + h  # the shared expert and its gate
    out += n_shared * _mlp(h, mi)
    return out


def _counts(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    """(parameters of the linear layers, parameters of embeddings and norms), or None when unknown."""
    fam = cfg.get("model_type")
    h, v, layers = _get(cfg, "hidden_size"), _get(cfg, "vocab_size"), _get(cfg, "num_hidden_layers")
    if not h or not v or not layers:
        return None
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = v * h * (1 if tied else 2) + h
    if fam in ("llama", "mistral"):
        heads, inter = _get(cfg, "num_attention_heads"), _get(cfg, "intermediate_size")
        if not heads or not inter:
            return None
        kv = _get(cfg, "num_key_value_heads", heads) or heads
        d = _get(cfg, "head_dim") or h // heads
        attn = h * heads * d * 2 + 2 * h * kv * d
        return layers * (attn + _mlp(h, inter)), embed + layers * 2 * h
    if fam in ("qwen3_next", "qwen3_5_text"):
        heads = _get(cfg, "num_attention_heads")
        need = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
        if not heads or any(not _get(cfg, k) for k in need):
            return None
        kv = _get(cfg, "num_key_value_heads", heads) or heads
        d = _get(cfg, "head_dim") or h // heads
        hk, hv = _get(cfg, "linear_num_key_heads") or 0, _get(cfg, "linear_num_value_heads") or 0
        kd = hk * (_get(cfg, "linear_key_head_dim") or 0)
        vd = hv * (_get(cfg, "linear_value_head_dim") or 0)
        full_attn = h * heads * d * 2 + 2 * h * kv * d + heads * d * h  # q carries its gate
        gdn = h * (2 * kd + 2 * vd) + h * 2 * hv + vd * h + (2 * kd + vd) * (_get(cfg, "linear_conv_kernel_dim") or 0)
        every = _get(cfg, "full_attention_interval", 4) or 4
        types = cfg.get("layer_types")
        n_full = (sum(t == "full_attention" for t in types) if isinstance(types, list)
                  else sum((i + 1) % every == 0 for i in range(layers)))
        mlp = _moe(cfg, h, "num_experts")
        if mlp is None:
            inter = _get(cfg, "intermediate_size")
            if not inter:
                return None
            mlp = _mlp(h, inter)
        return n_full * full_attn + (layers - n_full) * gdn + layers * mlp, embed + layers * 2 * h
    if fam in ("deepseek_v3", "deepseek_v32"):
        need = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "intermediate_size")
        if any(not _get(cfg, k) for k in need):
            return None
        heads, ql, kl = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, vh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        attn = h * ql + ql * heads * (nope + rope) + h * (kl + rope) + kl * heads * (nope + vh) + heads * vh * h
        if fam == "deepseek_v32":
            ih, idim = _get(cfg, "index_n_heads", 64) or 64, _get(cfg, "index_head_dim", 128) or 128
            attn += ql * ih * idim + h * idim + h * ih
        dense = _get(cfg, "first_k_dense_replace", 0) or 0
        moe = _moe(cfg, h, "n_routed_experts")
        if moe is None:
            return None
        linear = layers * attn + dense * _mlp(h, cfg["intermediate_size"]) + (layers - dense) * moe
        return linear, embed + layers * (2 * h + ql + kl)
    return None


def model_parameters(config: Mapping[str, Any]) -> int | None:
    """The model's parameter count, or None for a family (or a config) whose count is not modelled."""
    counts = _counts(text_config(config))
    return None if counts is None else sum(counts)


def model_weight_bytes(config: Mapping[str, Any]) -> int | None:
    """Bytes of the model's weights (see the module's docstring), or None when not modelled."""
    cfg = text_config(config)
    counts = _counts(cfg)
    if counts is None:
        return None
    linear, rest = counts
    try:
        size = config_dtype(cfg if ("dtype" in cfg or "torch_dtype" in cfg) else config).itemsize
    except ValueError:
        return None
    quant = config.get("quantization_config")
    linear_size = 1 if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else size
    return linear * linear_size + rest * size


def rank_weight_bytes(weight_bytes: int, tp: int, pp: int) -> int:
    """One rank's share of ``weight_bytes`` at ``tp`` x ``pp`` (rounded up)."""
    return -(-weight_bytes // (max(1, tp) * max(1, pp)))


_QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next", "hidden_size": 2048, "vocab_size": 151936, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 512, "num_experts_per_tok": 10, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
_LLAMA_3_8B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "vocab_size": 128256, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "vocab_size": 129280, "num_hidden_layers": 61,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                       "weight_block_size": [128, 128]}}

PRESET_MODELS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "qwen3-next-hybrid": _QWEN3_NEXT_80B,
    # Qwen3.8 Flash Next's published sizes are Qwen3-Next-80B's (the preset is that config plus QSA and PLE);
    # its PLE tables are not counted.
    "qwen3.8-flash-next": _QWEN3_NEXT_80B,
    "llama-dense": _LLAMA_3_8B,
    "deepseek-mla": _DEEPSEEK_V3,
})
"""The real model each preset stands for (the fields that size its weights)."""

PRESET_WEIGHT_BYTES: Mapping[str, int] = MappingProxyType(
    {name: b for name, cfg in PRESET_MODELS.items() if (b := model_weight_bytes(cfg)) is not None})
"""Weight bytes of each preset's real model."""
