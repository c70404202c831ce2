"""vLLM 0.33.0's own verdict on rendered `vllm serve` commands; runs in the vLLM venv (scripts/vllm-venv.sh).

    python check_vllm.py LIBCUDA CASES.json RESULTS.json

Each case is ``{"id", "argv", "env"}``: the argv after ``vllm serve`` and the engine container's
environment. vLLM is imported once here, behind the shims of ``shims/h200.py`` (a stand-in libcuda, Triton's
driver active, an H200 platform); every case runs in a forked child with exactly the case's environment,
through what ``vllm serve`` runs before it touches a GPU:

1. the ``vllm`` CLI parser with the ``serve`` subcommand (``FlexibleArgumentParser``: abbreviations, dotted
   JSON keys, ``-O``), and ``ServeSubcommand.validate``;
2. ``ServeSubcommand.cmd`` with its launchers (``run_server``, ``run_headless``, ...) replaced by recorders,
   so its own checks (load-balancing modes, API server counts) run;
3. ``AsyncEngineArgs.from_cli_args`` + ``create_engine_config`` (headless where ``cmd`` would go headless);
4. the scheduler-side KV connector: ``KVConnectorFactory.create_connector(config, SCHEDULER, kv_cache_config)``
   with one KV-cache group per kind of layer of the model;
5. for NIXL, ``compute_nixl_compatibility_hash`` (``nixl/metadata.py``), the value both roles compare at
   the handshake: the caller compares the prefill's with the decode's.

A result names the connector vLLM ended up with and whether the hybrid KV-cache manager is on, so the
caller sees the silent changes (``--kv-offloading-size`` replacing the connector) as well as the refusals.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import sys
import time
import traceback

CASE_TIMEOUT_S = 120
SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shims")


def _parser():
    from vllm.entrypoints.cli import serve as serve_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmd = serve_mod.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    return parser, cmd, serve_mod


def _kv_cache_config(cfg):
    """One KV-cache group per kind of layer, as vLLM's planner groups them (sizes do not matter to the
    scheduler-side connector: it reads the groups, their kinds and the block size)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
    )

    mc = cfg.model_config
    block = cfg.cache_config.block_size
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.bfloat16
    n = mc.get_total_num_hidden_layers()
    text = mc.hf_text_config
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    full = [f"model.layers.{i}.self_attn.attn" for i, t in enumerate(types) if t != "linear_attention"]
    linear = [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]
    if mc.use_mla:
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=mc.get_head_size(), dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block, num_kv_heads=max(1, mc.get_total_num_kv_heads()),
                                 head_size=mc.get_head_size(), dtype=dtype)
    groups = [KVCacheGroupSpec(full, spec)] if full else []
    if linear:
        groups.append(KVCacheGroupSpec(linear, MambaSpec(block_size=block, shapes=((4, 64), (8, 64)),
                                                         dtypes=(dtype, dtype))))
    return KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=groups)


def _check(case: dict) -> dict:
    parser, cmd, serve_mod = _parser()
    launched: list[str] = []

    async def run_server(args, *a, **k):
        launched.append("api_server")

    serve_mod.run_server = run_server
    serve_mod.run_headless = lambda args: launched.append("headless")
    serve_mod.run_multi_api_server = lambda args: launched.append("multi_api_server")
    serve_mod.run_dp_supervisor = lambda args: launched.append("dp_supervisor")
    args = parser.parse_args(["serve", *case["argv"]])
    cmd.validate(args)
    serve_mod.ServeSubcommand.cmd(args)  # its own checks; the launcher it picks is recorded

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs.from_cli_args(args)
    cfg = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER,
                                           headless=launched == ["headless"])
    kv = cfg.kv_transfer_config
    out = {"ok": True, "launcher": launched[0] if launched else None,
           "connector": kv.kv_connector if kv else None, "kv_role": kv.kv_role if kv else None,
           "hma": not cfg.scheduler_config.disable_hybrid_kv_cache_manager,
           "hybrid": cfg.model_config.is_hybrid,
           "tp": cfg.parallel_config.tensor_parallel_size, "pp": cfg.parallel_config.pipeline_parallel_size,
           "dp": cfg.parallel_config.data_parallel_size, "ep": cfg.parallel_config.enable_expert_parallel,
           "block_size": cfg.cache_config.block_size}
    if kv is not None and kv.kv_connector:
        connector = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config(cfg))
        out["connector_class"] = type(connector).__name__
        if kv.kv_connector.startswith("Nixl"):
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
                compute_nixl_compatibility_hash,
            )

            # the resolved attention backend is a GPU-worker fact: the configured one stands for it
            backend = str(cfg.attention_config.backend) if cfg.attention_config.backend else "auto"
            mode = "push" if kv.kv_connector == "NixlPushConnector" else "pull"
            out["nixl_hash"] = compute_nixl_compatibility_hash(cfg, backend, mode)
    return out


def _child(case: dict, w: int) -> None:
    signal.alarm(CASE_TIMEOUT_S)
    out = io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(case["env"])
        sys.stdout = sys.stderr = out
        import logging

        logging.disable(logging.CRITICAL)
        result = _check(case)
    except SystemExit as exc:  # argparse: unknown flag or bad value
        errors = [line for line in out.getvalue().splitlines() if ": error: " in line]
        result = {"ok": False, "type": "SystemExit",
                  "message": f"exit {exc.code}: {errors[-1] if errors else out.getvalue()[-500:]}"}
    except BaseException as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                      if "/vllm/" in f.filename), "")
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:2000], "where": where}
    os.write(w, json.dumps(result).encode())
    os._exit(0)


def run_case(case: dict) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(case, w)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + CASE_TIMEOUT_S + 10
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 1.0)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"ok": False, "type": "ChildDied", "message": f"wait status {status}"}
    return json.loads(b"".join(chunks))


def _architectures(model_dirs) -> set[str]:
    """The architectures the model directories' config.json name (an unreadable one names none)."""
    archs: set[str] = set()
    for model in model_dirs:
        with contextlib.suppress(OSError, ValueError), open(os.path.join(model, "config.json")) as f:
            archs.update(json.load(f).get("architectures") or ())
    return archs


def main(libcuda: str, cases_file: str, results_file: str) -> int:
    t0 = time.monotonic()
    sys.path.insert(0, SHIMS)
    import h200

    h200.load_libcuda(libcuda)
    h200.triton_driver_active()
    import vllm

    h200.install_platform()
    with open(cases_file) as f:
        cases = json.load(f)
    # warm: the parser, config and connector modules load once here, not in every child
    _parser()
    import vllm.distributed.kv_transfer.kv_connector.factory
    import vllm.engine.arg_utils
    for name in ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"):
        with contextlib.suppress(Exception):  # a connector that imports only in a child's state
            __import__(name)
    h200.inspect_models_ahead(_architectures(case["argv"][0] for case in cases), libcuda,
                              os.path.join(os.path.dirname(os.path.abspath(results_file)), "vllm-cache"))
    imported = time.monotonic() - t0
    results = {case["id"]: run_case(case) for case in cases}
    with open(results_file, "w") as f:
        json.dump({"vllm": vllm.__version__, "import_s": round(imported, 1),
                   "cases_s": round(time.monotonic() - t0 - imported, 1), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
