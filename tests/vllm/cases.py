"""vLLM check cases from PDDeployments: the `vllm serve` command and environment the operator renders, per role.

The argv and environment come from ``runtime_pod`` (what ``pdfleet render`` prints and the operator creates),
with check-only changes: the model argument points at a generated config.json directory of the preset's
model family, ``--load-format dummy`` is appended, and kubelet-filled values (fieldRef) get placeholders.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.validation import validate_object
from tests.unit.engine_rules.builders import vllm_obj
from tests.vllm.harness import CHECK_ONLY

PRESETS = ("qwen3.8-flash-next", "deepseek-mla", "llama-dense", "qwen3-next-hybrid")


def role_case(obj: dict, role: Role, model_dirs: dict[str, Path], home: Path, node_rank: int = 0) -> dict[str, Any]:
    spec = PDDeploymentSpec.model_validate(validate_object(obj).spec)
    pod = runtime_pod(obj["metadata"]["name"], "default", spec, role, "check", 0, node_rank)
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    argv = list(engine["command"][2:])  # after `vllm serve`
    argv[0] = str(model_dirs[spec.model.layout.preset or ""])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    for e in engine["env"]:
        env[e["name"]] = e["value"] if "value" in e else "127.0.0.1" if "IP" in e["name"] or "HOST" in e["name"] \
            else f"<{e['name'].lower()}>"
    env["HOME"] = str(home)
    env["HF_HOME"] = str(home / "huggingface")
    env["HF_HUB_OFFLINE"] = "1"
    return {"argv": argv + CHECK_ONLY, "env": env}


# Flags a user may put in engine.args that some vLLM check depends on (or that must pass), with values.
FEATURES: tuple[tuple[str, ...], ...] = (
    ("--max-num-seqs", "128"),
    ("--max_num_batched_tokens", "8192"),  # underscores, as vLLM accepts them
    ("--enforce-eager",),
    ("-O3",),
    ("--dtype", "float16"),
    ("--kv-cache-dtype", "fp8"),
    ("--block-size", "32"),
    ("--enable-sleep-mode",),
    ("--enable-return-routed-experts",),
    ("-dcp", "2"),
    ("--kv-offloading-size", "4"),
    ("--no-such-flag",),
    ("--gpu-memory-utilization", "0.85"),
)
ENV: tuple[tuple[str, str], ...] = (
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("MC_INTRANODE_NVLINK", "1"),
)


def _shape(rng: random.Random, tp: int, preset: str) -> dict[str, int]:
    out: dict[str, int] = {"tensor": tp}
    if tp > 1 and rng.random() < 0.3:
        out["data"] = rng.choice([d for d in (2, tp) if tp % d == 0])
    if tp > 1 and rng.random() < 0.3:
        out["expert"] = rng.choice([tp, tp, 2 if tp > 2 else tp])  # 2 of 4 or 8: no vLLM form
    return out


def generated_specs(n: int, seed: int = 41) -> list[dict]:
    """``n`` seeded vLLM PDDeployments over presets, connectors, protocols, shapes, flags and env."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        backend = rng.choice(["nixl", "nixl", "mooncake"])
        protocol = rng.choice(["rdma", "rdma", "tcp"] + (["nvlink"] if backend == "nixl" else []))
        transfer: dict[str, Any] = {"backend": backend, "protocol": protocol}
        if protocol == "rdma" and rng.random() < 0.3:
            transfer["rdmaDevices"] = ["mlx5_0", "mlx5_1"]
        preset = rng.choice(PRESETS)
        pp = rng.choice([1, 1, 1, 2])
        tps = {"prefill": rng.choice([1, 2, 4, 8]), "decode": rng.choice([1, 2, 4, 8])}
        shared: list[str] = []
        roles: dict[str, list[str]] = {"prefill": [], "decode": []}
        for feature in FEATURES:
            if rng.random() < 0.07:
                target = rng.choice(["shared", "prefill", "decode"])
                (shared if target == "shared" else roles[target]).extend(feature)
        obj = vllm_obj(spec__model__layout={"preset": preset}, spec__transfer=transfer,
                       spec__prefill__parallelism={**_shape(rng, tps["prefill"], preset), "pipeline": pp},
                       spec__decode__parallelism={**_shape(rng, tps["decode"], preset),
                                                  "pipeline": rng.choice([1, pp])})
        obj["metadata"]["name"] = f"gen-{i}"
        if shared:
            obj["spec"]["engine"]["args"] = shared
        env = [{"name": k, "value": v} for k, v in ENV if rng.random() < 0.06]
        if env:
            obj["spec"]["engine"]["env"] = env
        for role, args in roles.items():
            if args:
                obj["spec"][role]["engine"] = {"args": args}
        if i % 4 == 3:  # a pinned Hub model: --revision, checked by the engine's own parser (no rng draw)
            obj["spec"]["model"]["source"] = {"huggingFace": {
                "id": "pdfleet/check-model", "revision": hashlib.sha1(obj["metadata"]["name"].encode()).hexdigest()}}
        out.append(obj)
    return out
