"""SGLang check cases from PDDeployments: the engine container the operator renders, per role.

The argv and environment come from ``runtime_pod`` (what ``pdfleet render`` prints and the operator
creates), with two check-only changes: ``--model-path`` points at a generated config.json directory
of the preset's model family, and ``--load-format dummy --device cuda`` are appended. Environment
values the kubelet fills (fieldRef, secretKeyRef) get placeholders; HOME is a writable directory.
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
from tests.sglang.harness import CHECK_ONLY
from tests.unit.engine_rules.builders import sglang_obj

PRESETS = ("qwen3.8-flash-next", "deepseek-mla", "llama-dense", "qwen3-next-hybrid")


def role_case(obj: dict, role: Role, model_dirs: dict[str, Path], home: Path, node_rank: int = 0) -> dict[str, Any]:
    """One role's engine check; ``node_rank`` picks the member of a multi-node replica group."""
    spec = PDDeploymentSpec.model_validate(validate_object(obj).spec)
    name = obj["metadata"]["name"]
    pod = runtime_pod(name, "default", spec, role, "check", 0, node_rank)  # the member pod the operator creates
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    argv = list(engine["command"][3:])
    argv[argv.index("--model-path") + 1] = str(model_dirs[spec.model.layout.preset or ""])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    for e in engine["env"]:
        env[e["name"]] = e["value"] if "value" in e else f"<{e['name'].lower()}>"
    env["HOME"] = str(home)
    env["HF_HOME"] = str(home / "huggingface")
    return {"argv": argv + CHECK_ONLY, "env": env}


# Flags a user may put in engine.args that some SGLang start-up check depends on, with values.
FEATURES: tuple[tuple[str, ...], ...] = (
    ("--enable-unified-memory",),
    ("--disaggregation-decode-allocation-policy", "prefill_complete"),
    ("--enable-pd-role-switch",),
    ("--enable-response-store",),
    ("--enable-watermark",),
    ("--disaggregation-decode-host-receive-threshold", "0.5"),
    ("--disaggregation-decode-host-receive-threshold", "1.5"),
    ("--disaggregation-decode-retraction-backup", "host_pool"),
    ("--disaggregation-decode-retraction-backup", "cpu_tensor"),
    ("--disaggregation-decode-enable-offload-kvcache",),
    ("--mem-fraction-static", "0.85"),
    ("--chunked-prefill-size", "8192"),
    ("--no-such-flag",),
    ("--disaggregation-decode-allocation-policy", "sometimes"),
)


def _nested(rng: random.Random, tp: int) -> dict[str, int]:
    """Attention DP and EP sizes inside ``tp`` (divisors of it), each set on about a quarter of roles."""
    out = {}
    for key in ("data", "expert"):
        if tp > 1 and rng.random() < 0.25:
            out[key] = rng.choice([d for d in (2, 4) if tp % d == 0])
    return out


# Replica groups across nodes (admission refuses nodesPerReplica > 1 until groups are built: the
# check shows every member's command would start) and shapes SGLang refuses at start, which the CRD's
# rules deny: (name, prefill parallelism, decode parallelism, layout preset).
MULTI_NODE: tuple[tuple[str, dict, dict, str], ...] = (
    ("mn-deepseek-16x2", {"tensor": 16, "data": 16, "expert": 16, "nodesPerReplica": 2},
     {"tensor": 16, "data": 16, "expert": 16, "nodesPerReplica": 2}, "deepseek-mla"),
    ("mn-deepseek-32x4", {"tensor": 16, "data": 16, "expert": 16, "nodesPerReplica": 2},
     {"tensor": 32, "data": 32, "expert": 32, "nodesPerReplica": 4}, "deepseek-mla"),
    ("mn-llama-tp8-pp2", {"tensor": 8, "pipeline": 2, "nodesPerReplica": 2}, {"tensor": 8}, "llama-dense"),
    ("bad-nodes-3", {"tensor": 16, "data": 16, "nodesPerReplica": 3}, {"tensor": 16}, "deepseek-mla"),
    ("bad-dp-3", {"tensor": 8, "data": 3}, {"tensor": 8, "data": 8}, "deepseek-mla"),
    ("bad-dp-6-of-4", {"tensor": 4}, {"tensor": 4, "data": 6}, "qwen3-next-hybrid"),
)


def multi_node_specs() -> list[dict]:
    out = []
    for name, prefill, decode, preset in MULTI_NODE:
        obj = sglang_obj(spec__model__layout={"preset": preset}, spec__prefill__parallelism=prefill,
                         spec__decode__parallelism=decode)
        obj["metadata"]["name"] = name
        out.append(obj)
    return out


def generated_specs(n: int, seed: int = 21) -> list[dict]:
    """``n`` seeded SGLang PDDeployments over presets, backends, protocols, shapes, flags and env."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        backend = rng.choice(["mooncake", "mooncake", "nixl", "mori"])
        protocol = "rdma" if backend == "mori" else rng.choice(["rdma", "rdma", "tcp"])
        transfer: dict[str, Any] = {"backend": backend, "protocol": protocol}
        if protocol == "rdma" and rng.random() < 0.4:
            if backend != "mori" and rng.random() < 0.5:
                transfer["rdmaDeviceMap"] = {"0": ["mlx5_0"], "1": ["mlx5_1", "mlx5_2"]}
            else:
                transfer["rdmaDevices"] = ["mlx5_0", "mlx5_1"]
        pp = rng.choice([1, 1, 2])
        tps = {"prefill": rng.choice([1, 2, 4]), "decode": rng.choice([1, 2, 4])}
        shared: list[str] = []
        roles: dict[str, list[str]] = {"prefill": [], "decode": []}
        for feature in FEATURES:
            if rng.random() < 0.09:
                target = rng.choice(["shared", "prefill", "decode"])
                (shared if target == "shared" else roles[target]).extend(feature)
        obj = sglang_obj(spec__model__layout={"preset": rng.choice(PRESETS)}, spec__transfer=transfer,
                         spec__prefill__parallelism={"tensor": tps["prefill"], "pipeline": pp,
                                                     **_nested(rng, tps["prefill"])},
                         spec__decode__parallelism={"tensor": tps["decode"], "pipeline": rng.choice([1, pp]),
                                                    **_nested(rng, tps["decode"])},
                         spec__engine__stagingBuffer=rng.random() < 0.15)
        obj["metadata"]["name"] = f"gen-{i}"
        if shared:
            obj["spec"]["engine"]["args"] = shared
        if rng.random() < 0.1:
            obj["spec"]["engine"]["env"] = [{"name": "SGLANG_DISAGG_STAGING_BUFFER",
                                             "value": rng.choice(["true", "0", "yes"])}]
        for role, args in roles.items():
            if args:
                obj["spec"][role]["engine"] = {"args": args}
        if i % 4 == 3:  # a pinned Hub model: --revision, checked by the engine's own parser (no rng draw)
            obj["spec"]["model"]["source"] = {"huggingFace": {
                "id": "pdfleet/check-model", "revision": hashlib.sha1(obj["metadata"]["name"].encode()).hexdigest()}}
        out.append(obj)
    return out
