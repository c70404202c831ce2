"""SGLang 0.5.23's own memory pools, built on CPU from a config; runs in the SGLang check venv.

    python sglang_pools.py CASES.json RESULTS.json

Each case is ``{"id", "config", "tp", "page_size"}``. The pools are SGLang's classes, sized by SGLang's own
config classes (``Qwen3NextConfig``, ``Qwen3_5TextConfig``, ``Qwen4ExpTextConfig``, ``NemotronHConfig``:
their ``mamba2_cache_params``, ``short_conv_state_shape``, ``ngram_context_len``, QSA's ``parse_qsa_profile``)
under a TP width set with ``get_parallel().override(attn_tp_size=tp)``. Two things are set by hand, each
as SGLang computes it on a GPU pod: the KV heads per rank (``ModelConfig.get_num_kv_heads``:
``max(1, kv_heads // tp)``), and ``_is_cpu = False`` in the config modules (on a CPU host SGLang pads heads
for its AMX kernels; a GPU pod does not). Each result lists what SGLang registers for PD transfer: the KV
list (``get_contiguous_buf_infos``, ``get_kv_layer_ids``), the state list (``get_state_buf_infos`` and its
layer ids, sliceable dims, outer counts and conv shard groups), QSA's pending and compressed lists, and
DeepSeek-V3.2's DSA index list (``DSATokenToKVPool.get_state_buf_infos``: one packed page per item).
"""

from __future__ import annotations

import json
import sys
import traceback

SIZE = 256  # tokens of KV capacity (small: the item lengths do not depend on it)
SLOTS = 4


def _kv_heads(cfg: dict, tp: int) -> int:
    heads = cfg["num_attention_heads"]
    return max(1, cfg.get("num_key_value_heads", heads) // tp)


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _infos(ptrs_lens_items: tuple) -> list[int]:
    return [int(x) for x in ptrs_lens_items[2]]


def _state(pool) -> dict:
    groups = pool.get_state_conv_shard_groups()
    return {"items": _infos(pool.get_state_buf_infos()), "layers": [int(x) for x in pool.get_state_layer_ids()],
            "dims": [int(x) for x in pool.get_state_dim_per_tensor()],
            "outer": [int(x) for x in pool.get_state_slice_outer_counts()],
            "groups": [None if g is None else [int(x) for x in g] for g in groups]}


def _hybrid(cfg: dict, tp: int, page: int, torch) -> dict:
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    mt = cfg["model_type"]
    if mt == "qwen3_next":
        from sglang.srt.configs import qwen3_next as mod
        conf = mod.Qwen3NextConfig(**cfg)
    elif mt == "qwen3_5_text":
        from sglang.srt.configs import qwen3_5 as mod
        conf = mod.Qwen3_5TextConfig(**cfg)
    elif mt == "qwen4_exp_text":
        from sglang.srt.configs import qwen4_exp as mod
        conf = mod.Qwen4ExpTextConfig(**cfg)
    else:
        from sglang.srt.configs import nemotron_h as mod
        conf = mod.NemotronHConfig(**cfg)
    for m in (sys.modules.get("sglang.srt.configs.qwen3_next"), mod):
        if m is not None and hasattr(m, "_is_cpu"):
            m._is_cpu = False
    params = conf.mamba2_cache_params
    linear_ids = list(params.layers)
    full_ids = list(conf.full_attention_layer_ids)
    req = HybridReqToTokenPool(
        size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=0, max_context_len=SIZE, device="cpu",
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=linear_ids,
        enable_mamba_extra_buffer=False, enable_overlap_schedule=False,
        short_conv_layer_ids=getattr(conf, "short_conv_layer_ids", None) or None,
        short_conv_state_shape=getattr(conf, "short_conv_state_shape", None),
        ngram_context_len=getattr(conf, "ngram_context_len", 0) or 0)
    common = dict(size=SIZE, dtype=torch.bfloat16, page_size=page, head_num=_kv_heads(cfg, tp),
                  head_dim=_head_dim(cfg), full_attention_layer_ids=full_ids, device="cpu",
                  mamba_pool=req.mamba_pool)
    from sglang.srt.layers.attention.qsa.config import parse_qsa_profile

    profile = parse_qsa_profile(conf)
    out: dict = {}
    if profile is not None:
        pool = QSATokenToKVPool(**common, qsa_index_kv_heads=profile.kv_heads, qsa_index_head_dim=profile.head_dim,
                                qsa_compress_ratio=profile.compress_ratio, qsa_token_topk=profile.budget,
                                num_request_slots=SLOTS + 1)
        out["qsa_pending"] = {"items": _infos(pool.get_qsa_pending_state_buf_infos()),
                              "layers": [int(x) for x in pool.get_qsa_pending_state_layer_ids()]}
        out["qsa_compressed"] = {"items": _infos(pool.get_qsa_compressed_state_buf_infos()),
                                 "layers": [int(x) for x in pool.get_qsa_compressed_state_layer_ids()]}
    else:
        pool = HybridLinearKVPool(**common)
    out["kv"] = {"items": _infos(pool.get_contiguous_buf_infos()), "layers": [int(x) for x in pool.get_kv_layer_ids()]}
    out["state"] = _state(pool)
    return out


def _case(case: dict) -> dict:
    import torch
    from sglang.srt.runtime_context import get_parallel

    cfg, tp, page = case["config"], case["tp"], case["page_size"]
    cfg = {"model_type": "qwen4_exp_text", **cfg["text_config"]} if cfg.get("model_type") == "qwen4_exp" else cfg
    with get_parallel().override(attn_tp_size=tp, tp_size=tp, enable_cp_tp_group_sharing=False):
        mt = cfg["model_type"]
        if mt in ("llama", "mistral"):
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            n = cfg["num_hidden_layers"]
            pool = MHATokenToKVPool(size=SIZE, page_size=page, dtype=torch.bfloat16, head_num=_kv_heads(cfg, tp),
                                    head_dim=_head_dim(cfg), layer_num=n, device="cpu", enable_memory_saver=False)
            return {"kv": {"items": _infos(pool.get_contiguous_buf_infos()), "layers": list(range(n)) * 2}}
        if mt in ("deepseek_v3",):
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
            n = cfg["num_hidden_layers"]
            pool = MLATokenToKVPool(size=SIZE, page_size=page, dtype=torch.bfloat16,
                                    kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                                    layer_num=n, device="cpu", enable_memory_saver=False)
            return {"kv": {"items": _infos(pool.get_contiguous_buf_infos()), "layers": list(range(n))}}
        if mt == "deepseek_v32":  # the MLA pool plus DSA's fp8 index keys with scales (64-token pages)
            from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
            n, rank, rope = cfg["num_hidden_layers"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
            with get_parallel().override(attn_dcp_size=1):
                pool = DSATokenToKVPool(size=SIZE, page_size=page, kv_lora_rank=rank, dtype=torch.bfloat16,
                                        qk_rope_head_dim=rope, layer_num=n, device="cpu",
                                        index_head_dim=cfg["index_head_dim"], enable_memory_saver=False,
                                        kv_cache_dim=rank + rope)
            return {"kv": {"items": _infos(pool.get_contiguous_buf_infos()), "layers": list(range(n))},
                    "dsa_index": {"items": _infos(pool.get_state_buf_infos()), "layers": list(range(n))}}
        return _hybrid(cfg, tp, page, torch)


def main() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        try:
            results[case["id"]] = {"ok": True, **_case(case)}
        except BaseException as exc:  # reported per case
            results[case["id"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                   "trace": traceback.format_exc()[-3000:]}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
