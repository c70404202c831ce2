"""vLLM 0.33.0's own KV-cache specs for a config, on the faked H200; runs in the vLLM check venv.

    python vllm_specs.py LIBCUDA CASES.json RESULTS.json

Each case is ``{"id", "dir", "tp"}`` (a model directory holding config.json). Behind tests/vllm/shims/h200.py,
``AsyncEngineArgs(...).create_engine_config()`` builds the config a ``vllm serve DIR -tp N --load-format dummy``
pod gets; then, as vLLM's own block-size alignment reads them (``platforms/interface.py``
``_align_hybrid_block_size``): the attention spec of one token (``FullAttentionSpec`` / ``MLAAttentionSpec``
with ``model_config.get_num_kv_heads(parallel_config)``, ``get_head_size()``, the KV dtype) and, for a hybrid
model, the model class's ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (or
``get_mamba_specs_from_config``) and the resulting ``MambaSpec`` page sizes. Each case runs in a forked child
(of a parent that imported vLLM's modules and the cases' model classes once).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

SHIMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm", "shims")


def _spec(case: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    args = AsyncEngineArgs(model=case["dir"], tensor_parallel_size=case["tp"], load_format="dummy")
    cfg = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    mc, pc = cfg.model_config, cfg.parallel_config
    dtype = mc.dtype
    cls = MLAAttentionSpec if mc.use_mla else FullAttentionSpec
    attn = cls(block_size=1, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=dtype)
    out: dict = {"ok": True, "hybrid": bool(mc.is_hybrid), "mla": bool(mc.use_mla),
                 "num_kv_heads": mc.get_num_kv_heads(pc), "head_size": mc.get_head_size(), "dtype": str(dtype),
                 "attn_bytes_per_token": attn.page_size_bytes,
                 "sliding_window": mc.get_sliding_window(), "block_size": cfg.cache_config.block_size}
    if getattr(mc.hf_text_config, "index_topk", None):  # DeepSeek-V3.2's DSA indexer: its own cache spec
        out["indexer"] = _indexer_spec(cfg)
    if mc.is_hybrid:
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        if hasattr(model_cls, "get_mamba_specs_from_config"):
            specs = list(model_cls.get_mamba_specs_from_config(cfg))
        else:
            specs = [MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(cfg),
                               dtypes=model_cls.get_mamba_state_dtype_from_config(cfg), block_size=-1)]
        out["mamba"] = [{"shapes": [list(s) for s in sp.shapes], "dtypes": [str(d) for d in sp.dtypes],
                         "page_bytes": sp.page_size_bytes, "kind": type(sp).__name__} for sp in specs]
    return out


def _indexer_spec(cfg) -> dict:
    """The spec of vLLM's own indexer K cache, built as the model builds it (``Indexer`` of one layer)."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.deepseek_v2 import Indexer

    hf = cfg.model_config.hf_text_config
    with set_current_vllm_config(cfg):
        # One rank's groups on loopback (gloo): the indexer is replicated, the same on every TP rank.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        indexer = Indexer(cfg, hf, hf.hidden_size, hf.q_lora_rank, None, cfg.cache_config, None,
                          prefix="model.layers.0.self_attn.indexer")
        spec = indexer.k_cache.get_kv_cache_spec(cfg)
    return {"kind": type(spec).__name__, "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
            "dtype": str(spec.dtype), "bytes_per_block": spec.page_size_bytes, "block_size": spec.block_size}


def _child(case: dict, w: int) -> None:
    import io
    import logging

    logging.disable(logging.CRITICAL)
    sys.stdout = sys.stderr = io.StringIO()
    try:
        result = _spec(case)
    except BaseException as exc:  # reported per case
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    os.write(w, json.dumps(result).encode())
    os._exit(0)


def _run(case: dict) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(case, w)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks)) if chunks else {"ok": False, "error": "the child died"}


def _preload(cases: list[dict], libcuda: str, cache_root: str) -> None:
    """What every child would import again, imported once before they fork: vLLM's config and spec modules, and
    each case's model class, inspected as vLLM's registry does (``h200.inspect_models_ahead``; a hybrid
    family's module builds Triton launchers at import). The children still build every config and spec
    themselves (82 s -> 18 s with vLLM's inspection cache warm, idle host)."""
    import h200
    import vllm.engine.arg_utils
    import vllm.model_executor.models.deepseek_v2  # DeepSeek-V3.2's Indexer
    import vllm.usage.usage_lib
    import vllm.v1.kv_cache_interface  # noqa: F401

    archs: set[str] = set()
    for case in cases:
        with open(os.path.join(case["dir"], "config.json")) as f:
            archs.update(json.load(f).get("architectures") or ())
    h200.inspect_models_ahead(archs, libcuda, cache_root)


def main(libcuda: str, cases_file: str, results_file: str) -> None:
    # vLLM's hybrid model modules build Triton launchers at import, and vLLM inspects a model class in a
    # subprocess: both find the stand-in driver by path (tests/vllm/shims/libcuda_stub.c).
    where = os.path.dirname(os.path.abspath(libcuda))
    os.environ["TRITON_LIBCUDA_PATH"] = where
    os.environ["LD_LIBRARY_PATH"] = where + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    sys.path.insert(0, SHIMS)
    import h200

    h200.activate(libcuda)
    with open(cases_file) as f:
        cases = json.load(f)
    _preload(cases, libcuda, os.path.join(os.path.dirname(os.path.abspath(results_file)), "vllm-cache"))
    with open(results_file, "w") as f:
        json.dump({c["id"]: _run(c) for c in cases}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
