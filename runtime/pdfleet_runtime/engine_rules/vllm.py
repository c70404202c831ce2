"""vLLM as the engine of a PDDeployment: ports, connectors, owned flags and env, and the rules of vllm==0.33.0.

Everything here is data and pure functions read by the operator (admission, ``pdfleet render``,
``pdfleet matrix --engine vllm==0.33.0``); pdfleet imports no vLLM. Each rule names the vLLM file it comes
from (paths inside the installed ``vllm`` package) and whether the check harness (tests/vllm) confirmed it by
running vLLM's own code on a faked H200 (``confirmed: run``) or it was read from the source (``read``: it
fires on a GPU worker or at the handshake, which no CPU run reaches).

``when``: ``config`` (``vllm serve`` refuses the flags before any GPU work: the pod crash-loops),
``silent`` (vLLM accepts and quietly loses PD, or fails at engine start), ``gpu-worker`` (the GPU worker
raises at start), ``pair`` (each role starts; every handshake or transfer between them fails).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdfleet_runtime.engine_rules.vllm_argv import VllmArgs
from pdfleet_runtime.links import Backend, LinkProtocol

__all__ = [
    "CONNECTORS",
    "ENGINE_PORT",
    "HMA_CONNECTORS",
    "KV_ROLES",
    "MASTER_PORT",
    "MODEL_FAMILIES",
    "MOONCAKE_BOOTSTRAP_PORT",
    "NIXL_SIDE_CHANNEL_PORT",
    "NODE_GPUS",
    "OWNED_ENV",
    "OWNED_FLAGS",
    "PROTOCOLS",
    "RULES",
    "ModelFamily",
    "ProtocolSettings",
    "RoleView",
    "VllmRule",
    "vllm_parallel",
]

ENGINE_PORT = 30000  # --port: the same as SGLang's, so NetworkPolicy, routers and the agent name one port
NIXL_SIDE_CHANNEL_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT (vLLM's default), + the DP index per engine core
MOONCAKE_BOOTSTRAP_PORT = 8998  # VLLM_MOONCAKE_BOOTSTRAP_PORT (vLLM's default): the prefill's HTTP bootstrap
MASTER_PORT = 5000  # --master-port of a replica group's first pod (multi-node TP/PP)
NODE_GPUS = 8  # GPUs per node vLLM counts (an H200 node); TP x PP of one pod must fit (config/parallel.py)
KV_ROLES = MappingProxyType({"prefill": "kv_producer", "decode": "kv_consumer"})
CONNECTORS = MappingProxyType({Backend.NIXL: "NixlConnector", Backend.MOONCAKE: "MooncakeConnector"})
# connectors with hybrid-KV-cache (HMA) support in 0.33 (distributed/kv_transfer/kv_connector/factory.py)
HMA_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
                            "MoRIIOConnector", "OffloadingConnector", "SimpleCPUOffloadConnector",
                            "LMCacheMPConnector", "MultiConnector"})


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """What a layout preset is to vLLM: its config.json's architecture, and the facts rules read."""

    architecture: str
    model_type: str
    moe: bool
    hybrid: bool  # linear-attention (Mamba/GDN) layers: vLLM's hybrid KV-cache manager is required
    nested_text_config: bool = False


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({
    # vLLM counts Qwen4-Exp as hybrid (its linear-state layers): the check harness reads is_hybrid from vLLM
    "qwen3.8-flash-next": ModelFamily("Qwen4ExpForCausalLM", "qwen4_exp", moe=True, hybrid=True),
    "deepseek-mla": ModelFamily("DeepseekV3ForCausalLM", "deepseek_v3", moe=True, hybrid=False),
    "llama-dense": ModelFamily("LlamaForCausalLM", "llama", moe=False, hybrid=False),
    "qwen3-next-hybrid": ModelFamily("Qwen3NextForCausalLM", "qwen3_next", moe=True, hybrid=True),
})

# dest -> the field that owns it ("{role}" is spec.prefill or spec.decode)
OWNED_FLAGS: Mapping[str, str] = MappingProxyType({
    "model_tag": "spec.model.source",
    "model": "spec.model.source",
    "revision": "spec.model.source.huggingFace.revision",
    "served_model_name": "spec.model.servedName",
    "tensor_parallel_size": "{role}.parallelism.tensor (and .data: TP = tensor / data)",
    "pipeline_parallel_size": "{role}.parallelism.pipeline",
    "data_parallel_size": "{role}.parallelism.data",
    "data_parallel_size_local": "{role}.parallelism.data",
    "data_parallel_rank": "the operator (one API server per pod)",
    "data_parallel_start_rank": "the operator (one API server per pod)",
    "data_parallel_address": "the operator",
    "data_parallel_rpc_port": "the operator",
    "enable_expert_parallel": "{role}.parallelism.expert",
    "nnodes": "{role}.parallelism.nodesPerReplica",
    "node_rank": "the operator (each pod of a replica group gets its own)",
    "master_addr": "the operator (the replica group's first pod)",
    "master_port": "the operator (the replica group's first pod)",
    "headless": "the operator (members of a replica group after the first)",
    "host": "the operator (fixed: 0.0.0.0)",
    "port": "the operator (fixed: 30000)",
})
# the environment the operator renders from spec.transfer (a user's value would contradict it)
OWNED_ENV: Mapping[str, str] = MappingProxyType({
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the operator (the pod IP, from status.podIP)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "the operator (fixed: 5600)",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT": "the operator (fixed: 8998)",
    "VLLM_HOST_IP": "the operator (the pod IP, from status.podIP)",
})


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    """What one (backend, protocol) pair renders to on a vLLM pod."""

    extra_config: Mapping[str, str]  # kv_connector_extra_config
    env: Mapping[str, str]
    devices: str | None = None  # where rdmaDevices go: "ucx" (UCX_NET_DEVICES) or "mooncake" (device_name)
    host_ipc: bool = False
    note: str = ""


def _m(**kv: str) -> Mapping[str, str]:
    return MappingProxyType(kv)


PROTOCOLS: Mapping[tuple[Backend, LinkProtocol], ProtocolSettings] = MappingProxyType({
    (Backend.NIXL, LinkProtocol.RDMA): ProtocolSettings(
        _m(), _m(), devices="ucx", note="NIXL's UCX backend; rdmaDevices become UCX_NET_DEVICES (one list)"),
    (Backend.NIXL, LinkProtocol.TCP): ProtocolSettings(_m(), _m(UCX_TLS="tcp")),
    (Backend.NIXL, LinkProtocol.NVLINK): ProtocolSettings(
        _m(), _m(UCX_TLS="cuda_ipc,cuda_copy,tcp"), host_ipc=True,
        note="tcp stays listed: NIXL's UCX backend needs an active-message lane"),
    (Backend.MOONCAKE, LinkProtocol.RDMA): ProtocolSettings(
        _m(mooncake_protocol="rdma"), _m(), devices="mooncake",
        note="rdmaDevices become device_name, one string for every rank (vLLM has no per-GPU map)"),
    (Backend.MOONCAKE, LinkProtocol.TCP): ProtocolSettings(_m(mooncake_protocol="tcp"), _m()),
})


def vllm_parallel(tensor: int, data: int, expert: int) -> tuple[int, int, bool] | None:
    """pdfleet's (tensor, data, expert) as vLLM's (--tensor-parallel-size, --data-parallel-size,
    --enable-expert-parallel), or None when vLLM has no faithful form.

    pdfleet's ``data`` is attention DP inside TP (``tensor`` GPUs in all); vLLM's ``--data-parallel-size``
    multiplies GPUs (DP engine cores, each TP wide), with MoE layers spanning DP x TP. So ``tensor`` GPUs
    with attention DP ``data`` are vLLM's DP ``data`` x TP ``tensor / data``; MoE experts then span all
    ``tensor`` ranks either sharded (``expert`` 1) or whole (``expert`` = tensor: ``--enable-expert-parallel``,
    EP = DP x TP). An ``expert`` between the two has no vLLM form."""
    if tensor % data:
        return None
    if expert not in (1, tensor):
        return None
    return tensor // data, data, expert > 1


@dataclass(frozen=True)
class RoleView:
    """One role's vLLM engine as a rule reads it (its effective args and environment, and the spec's facts)."""

    role: str
    prefix: str
    args: VllmArgs
    arg_paths: tuple[str, ...]
    env: Mapping[str, str | None]
    env_paths: Mapping[str, str]
    tensor: int  # pdfleet's parallelism.tensor (GPUs of one replica, with pipeline)
    pipeline: int
    data: int
    expert: int
    nodes: int
    backend: Backend
    protocol: LinkProtocol
    version: str | None
    model: str | None  # layout preset
    state_types: frozenset[str]
    mla: bool
    kv_heads: int | None
    model_path: str

    @property
    def family(self) -> ModelFamily | None:
        return MODEL_FAMILIES.get(self.model) if self.model else None

    @property
    def vllm_tp(self) -> int:
        mapped = vllm_parallel(self.tensor, self.data, self.expert)
        return mapped[0] if mapped else self.tensor

    @property
    def hybrid(self) -> bool:
        fam = self.family
        return fam.hybrid if fam else "mamba" in self.state_types

    @property
    def moe(self) -> bool | None:
        fam = self.family
        return fam.moe if fam else None

    def has(self, dest: str) -> bool:
        v = self.args.parsed.values.get(dest)
        return bool(v) and v != "False"

    def value(self, dest: str, default: object = None) -> object:
        return self.args.parsed.values.get(dest, default)

    def flag_path(self, dest: str) -> str:
        at = self.args.parsed.where.get(dest)
        return self.arg_paths[self.args.origin[at[0]]] if at else f"{self.prefix}.engine.args"

    def written(self, dest: str) -> str:
        """The flag as the user wrote it, with its value (``--dtype float16``)."""
        at = self.args.parsed.where.get(dest)
        if at is None:
            return dest
        i = self.args.origin[at[0]]
        text = self.args.written[i]
        if "." in text.split("=", 1)[0] and "=" not in text and i + 1 < len(self.args.written):
            return f"{text} {self.args.written[i + 1]}"  # a dotted key, as written
        value = self.value(dest)
        if "=" in text or value is True or value is None:
            return text
        return f"{text} {value if not isinstance(value, tuple) else ' '.join(value)}"

    def env_path(self, name: str) -> str:
        return self.env_paths.get(name, f"{self.prefix}.engine.env")


Finding = tuple[str, tuple[str, ...]]
Check = Callable[[RoleView, RoleView], "list[Finding]"]


@dataclass(frozen=True, slots=True)
class VllmRule:
    """One vLLM rule: ``check(view, peer) -> [(message, paths)]`` (every hit, so none hides another)."""

    id: str
    title: str
    reason: str
    fix: str
    source: str
    when: str  # "config", "silent", "gpu-worker", "pair"
    confirmed: str  # "run" (the harness ran vLLM's code) or "read" (from the source)
    check: Check


_KV = "distributed/kv_transfer/kv_connector/"
_NIXL_WORKER = _KV + "v1/nixl/base_worker.py"


def _user_kv_config(v: RoleView) -> dict:
    raw = v.value("kv_transfer_config")
    if isinstance(raw, str):
        try:
            out = json.loads(raw)
            return out if isinstance(out, dict) else {}
        except ValueError:
            return {}
    return {}


def _kv_transfer_config(v: RoleView, _: RoleView) -> list[Finding]:
    if not v.args.parsed.where.get("kv_transfer_config"):
        return []
    return [(f"{v.role}: {v.written('kv_transfer_config')} overrides the PD connector pdfleet renders from "
             "spec.transfer.backend", (v.flag_path("kv_transfer_config"),))]


def _hybrid_connector(v: RoleView, _: RoleView) -> list[Finding]:
    name = _user_kv_config(v).get("kv_connector")
    if v.hybrid and isinstance(name, str) and name not in HMA_CONNECTORS:
        return [(f"{v.role}: {name} has no hybrid-KV-cache support and {v.model} is a hybrid model: vLLM turns "
                 "the hybrid KV-cache manager off and the engine fails at start",
                 (v.flag_path("kv_transfer_config"), "spec.model.layout"))]
    return []


def _offloading(v: RoleView, _: RoleView) -> list[Finding]:
    out: list[Finding] = []
    for dest in ("kv_offloading_size", "kv_offloading_backend"):
        if dest in v.args.parsed.where:
            out.append((f"{v.role}: {v.written(dest)} replaces the {CONNECTORS.get(v.backend, 'PD')} connector "
                        "with an offloading connector in role kv_both: no KV moves between roles, the decode "
                        "recomputes every prompt", (v.flag_path(dest),)))
    return out


def _config_file(v: RoleView, _: RoleView) -> list[Finding]:
    w = v.args.written
    return [(f"{v.role}: {w[i]}{' ' + w[i + 1] if w[i] == '--config' and i + 1 < len(w) else ''} reads flags "
             "from a file admission cannot see", (v.arg_paths[i],)) for i in v.args.config_files]


def _env_owned(v: RoleView, _: RoleView) -> list[Finding]:
    return [(f"{v.role}: {name}={v.env.get(name)} is owned by {owner}", (v.env_path(name),))
            for name, owner in OWNED_ENV.items() if name in v.env_paths and v.env_paths[name].startswith("spec.")
            and ".engine.env" in v.env_paths[name]]


def _expert_mapping(v: RoleView, _: RoleView) -> list[Finding]:
    if vllm_parallel(v.tensor, v.data, v.expert) is None and v.tensor % v.data == 0:
        return [(f"{v.role}: parallelism.expert {v.expert} with tensor {v.tensor}: vLLM's expert parallelism "
                 "spans all DP x TP ranks (expert = tensor) or none (expert = 1)",
                 (f"{v.prefix}.parallelism.expert",))]
    return []


def _multi_node_dp(v: RoleView, _: RoleView) -> list[Finding]:
    if v.nodes > 1 and v.data > 1:
        return [(f"{v.role}: nodesPerReplica {v.nodes} with parallelism.data {v.data}: vLLM's data parallelism "
                 "across nodes (--data-parallel-size-local, --data-parallel-address, one API server) is not "
                 "rendered", (f"{v.prefix}.parallelism.nodesPerReplica", f"{v.prefix}.parallelism.data"))]
    return []


def _expert_dense(v: RoleView, _: RoleView) -> list[Finding]:
    if v.expert > 1 and v.moe is False:
        return [(f"{v.role}: parallelism.expert {v.expert} on {v.model}, a model without experts",
                 (f"{v.prefix}.parallelism.expert", "spec.model.layout"))]
    return []


def _world_size(v: RoleView, _: RoleView) -> list[Finding]:
    per_node = v.vllm_tp * v.pipeline // max(1, v.nodes)
    if v.nodes == 1 and per_node > NODE_GPUS:
        return [(f"{v.role}: TP {v.vllm_tp} x PP {v.pipeline} = {per_node} GPUs in one pod, more than a node's "
                 f"{NODE_GPUS}", (f"{v.prefix}.parallelism.tensor", f"{v.prefix}.parallelism.pipeline"))]
    return []


def _int(v: RoleView, dest: str, default: int) -> int:
    try:
        value = v.value(dest, default)
        return int(value) if isinstance(value, (int, str, float)) else default
    except (TypeError, ValueError):
        return default


def _dcp_nixl(v: RoleView, _: RoleView) -> list[Finding]:
    dcp = _int(v, "decode_context_parallel_size", 1)
    if v.backend is not Backend.NIXL or dcp == 1:
        return []
    pcp = _int(v, "prefill_context_parallel_size", 1)
    if dcp != max(v.vllm_tp, pcp):
        return [(f"{v.role}: {v.written('decode_context_parallel_size')} with NIXL must be 1 or the transfer "
                 f"parallel size {max(v.vllm_tp, pcp)}", (v.flag_path("decode_context_parallel_size"),))]
    if not v.mla:
        return [(f"{v.role}: {v.written('decode_context_parallel_size')} with NIXL needs an MLA model",
                 (v.flag_path("decode_context_parallel_size"), "spec.model.layout"))]
    return []


def _dcp_shape(v: RoleView, _: RoleView) -> list[Finding]:
    dcp = _int(v, "decode_context_parallel_size", 1)
    if dcp == 1 or _int(v, "prefill_context_parallel_size", 1) != 1:
        return []
    tp, flag = v.vllm_tp, v.written("decode_context_parallel_size")
    if tp % dcp:
        return [(f"{v.role}: {flag} does not divide vLLM's TP {tp}", (v.flag_path("decode_context_parallel_size"),
                                                                     f"{v.prefix}.parallelism.tensor"))]
    if not v.mla and v.kv_heads is not None and (tp <= v.kv_heads or dcp > tp // v.kv_heads):
        return [(f"{v.role}: {flag} on a GQA/MQA model needs vLLM's TP {tp} above the {v.kv_heads} KV heads and "
                 f"DCP at most TP / KV heads", (v.flag_path("decode_context_parallel_size"),
                                                f"{v.prefix}.parallelism.tensor"))]
    return []


def _routed_experts(v: RoleView, _: RoleView) -> list[Finding]:
    if v.has("enable_return_routed_experts"):
        return [(f"{v.role}: {v.written('enable_return_routed_experts')} with the {CONNECTORS[v.backend]}",
                 (v.flag_path("enable_return_routed_experts"), "spec.transfer.backend"))]
    return []


def _expandable(v: RoleView, _: RoleView) -> list[Finding]:
    conf = v.env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "expandable_segments:True" in conf and not v.has("enable_sleep_mode") \
            and not v.has("enable_cumem_allocator"):
        return [(f"{v.role}: PYTORCH_CUDA_ALLOC_CONF={conf} with the {CONNECTORS[v.backend]}",
                 (v.env_path("PYTORCH_CUDA_ALLOC_CONF"),))]
    return []


_MC_NVLINK = ("MC_FORCE_MNNVL", "MC_INTRANODE_NVLINK", "MC_USE_TENT", "MC_USE_TEV1")


def _sleep_mode(v: RoleView, _: RoleView) -> list[Finding]:
    if not v.has("enable_sleep_mode") or v.backend is not Backend.MOONCAKE:
        return []
    set_vars = [n for n in _MC_NVLINK if n in v.env]
    if set_vars:
        return [(f"{v.role}: {v.written('enable_sleep_mode')} with Mooncake and {set_vars[0]}={v.env[set_vars[0]]}",
                 (v.flag_path("enable_sleep_mode"), v.env_path(set_vars[0])))]
    if v.protocol is not LinkProtocol.RDMA:
        return [(f"{v.role}: {v.written('enable_sleep_mode')} with Mooncake over {v.protocol}",
                 (v.flag_path("enable_sleep_mode"), "spec.transfer.protocol"))]
    return []


def _nixl_pp_hybrid(v: RoleView, _: RoleView) -> list[Finding]:
    if v.backend is Backend.NIXL and v.pipeline > 1 and v.hybrid and not v.has("disable_hybrid_kv_cache_manager"):
        return [(f"{v.role}: NIXL (pull) with PP {v.pipeline} on {v.model}, a hybrid model",
                 (f"{v.prefix}.parallelism.pipeline", "spec.transfer.backend"))]
    return []


def _nixl_pp_decode(v: RoleView, _: RoleView) -> list[Finding]:
    if v.backend is Backend.NIXL and v.role == "decode" and v.pipeline > 1:
        return [(f"decode: NIXL with PP {v.pipeline} on the consumer", ("spec.decode.parallelism.pipeline",))]
    return []


# what NIXL's compatibility hash covers that a role's args or env can change (nixl/metadata.py)
_HASHED = (("dtype", "auto"), ("kv_cache_dtype", "auto"), ("disable_hybrid_kv_cache_manager", None),
           ("speculative_config", None), ("attention_backend", None), ("hf_overrides", None),
           ("revision", None), ("code_revision", None))


def _pair_hash(v: RoleView, p: RoleView) -> list[Finding]:
    if v.role != "decode" or v.backend is not Backend.NIXL:
        return []  # checked once, on decode (it names both sides)
    out: list[Finding] = []
    if v.version != p.version:
        out.append((f"vLLM version differs: prefill {p.version}, decode {v.version}",
                    ("spec.prefill.engine.version", "spec.decode.engine.version")))
    if v.model_path != p.model_path:
        out.append((f"model path differs: prefill {p.model_path}, decode {v.model_path}", ("spec.model.source",)))
    for dest, default in _HASHED:
        mine, theirs = v.value(dest, default), p.value(dest, default)
        if str(mine) != str(theirs):
            side = [f"{r.role} {r.written(dest) if dest in r.args.parsed.where else '(default)'}" for r in (p, v)]
            paths = tuple(r.flag_path(dest) for r in (p, v) if dest in r.args.parsed.where)
            out.append((f"{dest.replace('_', '-')} differs between the roles: {', '.join(side)}", paths))
    for name in ("VLLM_ATTENTION_BACKEND",):
        if v.env.get(name) != p.env.get(name):
            out.append((f"{name} differs between the roles: prefill {p.env.get(name)}, decode {v.env.get(name)}",
                        tuple(r.env_path(name) for r in (p, v) if name in r.env)))
    return out


def _hetero_tp(v: RoleView, p: RoleView) -> list[Finding]:
    if v.role != "decode" or v.backend is not Backend.NIXL:
        return []
    ptp, dtp = p.vllm_tp, v.vllm_tp
    out: list[Finding] = []
    if max(ptp, dtp) % min(ptp, dtp):
        out.append((f"vLLM TP sizes {ptp} (prefill) and {dtp} (decode) do not divide one another",
                    ("spec.prefill.parallelism.tensor", "spec.decode.parallelism.tensor")))
    elif not v.mla and not v.hybrid and v.kv_heads is not None and ptp > dtp and ptp > v.kv_heads:
        out.append((f"prefill TP {ptp} > decode TP {dtp} and > the model's {v.kv_heads} KV heads (replicated KV "
                    "read by fewer ranks)", ("spec.prefill.parallelism.tensor", "spec.decode.parallelism.tensor")))
    return out


def _block_size(v: RoleView, p: RoleView) -> list[Finding]:
    if v.role != "decode" or v.backend is not Backend.NIXL:
        return []
    default = None if v.hybrid else 16  # vLLM's CUDA default; hybrid models align it to their state pages
    mine, theirs = _int(v, "block_size", default or 0), _int(p, "block_size", default or 0)
    if mine and theirs and mine % theirs:
        return [(f"decode block size {mine} is not a multiple of the prefill's {theirs}",
                 tuple(r.flag_path("block_size") for r in (p, v) if "block_size" in r.args.parsed.where))]
    return []


def _rule(id: str, title: str, reason: str, fix: str, source: str, when: str, confirmed: str,
          check: Check) -> VllmRule:
    return VllmRule(f"vllm.{id}", title, reason, fix, source, when, confirmed, check)


RULES_0_33_0: tuple[VllmRule, ...] = (
    _rule("kv-transfer-config", "--kv-transfer-config is rendered by the operator",
          "the PD connector and its role come from spec.transfer and the role; an override loses PD (another "
          "connector, kv_both) or breaks the pair, and vLLM accepts it (kserve #5987: decode recomputed every "
          "prompt while healthy)", "remove it and set spec.transfer.backend/protocol",
          "config/kv_transfer.py", "silent", "run", _kv_transfer_config),
    _rule("hybrid-connector", "a connector without hybrid-KV-cache support on a hybrid model",
          "vLLM turns the hybrid KV-cache manager off with a warning and the engine fails at start (\"Failed to "
          "promote local KV cache specs\")", "use NixlConnector or MooncakeConnector (spec.transfer.backend)",
          "config/vllm.py (HMA auto-disable), v1/core/kv_cache_planning.py:814", "silent", "read",
          _hybrid_connector),
    _rule("kv-offloading-size", "--kv-offloading-size / --kv-offloading-backend replace the PD connector",
          "vLLM rewrites the kv-transfer-config to OffloadingConnector (or LMCacheMPConnector) in role kv_both "
          "without an error: PD is lost while every pod is healthy", "remove the flag",
          "config/vllm.py _post_init_kv_transfer_config", "silent", "run", _offloading),
    _rule("config-file", "--config reads flags from a file", "admission checks every flag of a role; flags "
          "in a file it cannot see would bypass the owned-flag, pair and start-up rules",
          "put the flags in engine.args", "utils/argparse_utils.py _pull_args_from_config", "config", "read",
          _config_file),
    _rule("env-owned", "the operator renders this variable", "the side channel and bootstrap addresses come "
          "from the pod and fixed ports; another value breaks the handshake", "remove it from engine.env",
          "envs.py", "config", "read", _env_owned),
    _rule("expert-mapping", "parallelism.expert has no vLLM form", "vLLM's --enable-expert-parallel spreads "
          "experts over all DP x TP ranks; pdfleet's expert must then be 1 or equal to tensor",
          "set parallelism.expert to 1 or to parallelism.tensor", "config/parallel.py", "config", "read",
          _expert_mapping),
    _rule("multi-node-dp", "data parallelism across nodes is not rendered for vLLM",
          "pdfleet renders vLLM's multi-node start for TP/PP (--nnodes/--node-rank/--master-addr, --headless on "
          "members); DP across nodes needs one API server and DP-rank addressing that part 1 does not render",
          "use parallelism.data 1 with nodesPerReplica > 1, or fit the replica on one node",
          "entrypoints/cli/serve.py", "config", "read", _multi_node_dp),
    _rule("expert-dense", "expert parallelism on a model without experts",
          "vLLM refuses --enable-expert-parallel when the model has no experts",
          "set parallelism.expert to 1", "config/model.py _verify_with_expert_parallelism", "config", "run",
          _expert_dense),
    _rule("world-size-node", "TP x PP of one pod exceeds a node's GPUs",
          f"vLLM's multiprocessing executor checks TP x PP against the node's GPUs ({NODE_GPUS} on H200 nodes)",
          "lower tensor x pipeline, or span nodes with nodesPerReplica", "config/parallel.py:1068", "config",
          "run", _world_size),
    _rule("dcp-shape", "decode context parallelism must divide TP; on GQA/MQA, TP above the KV heads",
          "DCP reuses TP ranks (TP % DCP == 0); without MLA each DCP shard needs its own KV heads (TP > KV heads, "
          "DCP <= TP / KV heads). vLLM also requires the query heads per KV head to divide by DCP: the layout has "
          "no query-head count, so that one is left to vLLM", "set --decode-context-parallel-size to a divisor of "
          "TP that fits the KV heads, or remove it", "config/parallel.py:600, config/model.py:1578", "config", "run",
          _dcp_shape),
    _rule("dcp-nixl", "decode context parallelism with NIXL: 1 or the TP size, MLA only",
          "a NIXL side is either fully replicated or fully DCP-sharded, and only MLA's latent cache shards",
          "remove --decode-context-parallel-size, or set it to the TP size on an MLA model",
          "config/vllm.py:1572", "config", "run", _dcp_nixl),
    _rule("routed-experts-pd", "--enable-return-routed-experts with a PD connector",
          "vLLM's auxiliary outputs are not carried across PD", "remove --enable-return-routed-experts",
          "config/vllm.py _verify_aux_output_compatibility", "config", "run", _routed_experts),
    _rule("expandable-segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with a KV connector",
          "CUDA VMM may remap the KV cache's pages, invalidating the memory NIXL or Mooncake registered",
          "unset expandable_segments:True, or add --enable-cumem-allocator", "config/vllm.py _verify_kv_transfer_compat",
          "config", "run", _expandable),
    _rule("sleep-mode-mooncake", "sleep mode with Mooncake needs RDMA and no NVLink/TENT variables",
          "MooncakeConnector.supports_sleep_mode is false over tcp or with MC_FORCE_MNNVL, MC_INTRANODE_NVLINK, "
          "MC_USE_TENT or MC_USE_TEV1 set", "remove --enable-sleep-mode, or use protocol rdma without those variables",
          _KV + "v1/mooncake/mooncake_connector.py supports_sleep_mode", "config", "run", _sleep_mode),
    _rule("nixl-pp-hybrid", "NIXL (pull) with PP > 1 on a hybrid model",
          "the pull worker has no pipeline-sharded hybrid layout (NotImplementedError at GPU worker start)",
          "use pipeline 1 on a hybrid model with NIXL, or Mooncake", _NIXL_WORKER + ":872", "gpu-worker", "read",
          _nixl_pp_hybrid),
    _rule("nixl-pp-decode", "NIXL with PP > 1 on the decode",
          "the NIXL consumer counts completions per rank and refuses pipeline stages (NotImplementedError at GPU "
          "worker start)", "set spec.decode.parallelism.pipeline to 1", _NIXL_WORKER + ":886", "gpu-worker", "read",
          _nixl_pp_decode),
    _rule("nixl-compat-hash", "prefill and decode differ in what NIXL's compatibility hash covers",
          "vLLM's version, the model path, dtype, KV-cache dtype, hybrid caching, speculative config, attention "
          "backend and push vs pull are hashed; a mismatch fails every handshake (every request)",
          "set these flags in spec.engine.args (both roles), and move both roles' versions together",
          _KV + "v1/nixl/metadata.py compute_nixl_compatibility_hash", "pair", "run", _pair_hash),
    _rule("nixl-hetero-tp", "NIXL across TP sizes: sizes must divide; no replicated KV read by fewer ranks",
          "the decode reads each prefill rank's KV; prefill TP > decode TP with KV replicated over prefill "
          "ranks (TP > KV heads) asserts on a non-MLA, non-hybrid model",
          "use equal TP, or a prefill TP within the KV heads", _KV + "utils.py:522, " + _NIXL_WORKER + ":2727",
          "pair", "read", _hetero_tp),
    _rule("nixl-block-size", "NIXL: the decode's block size must be a multiple of the prefill's",
          "the decode maps remote blocks onto its own by the ratio of the two block sizes",
          "set --block-size in spec.engine.args (both roles)", _KV + "utils.py:540", "pair", "read", _block_size),
)

RULES: Mapping[str, tuple[VllmRule, ...]] = MappingProxyType({"0.33.0": RULES_0_33_0})
"""Rules per vLLM version; a version is known iff it has rules and a flag set."""
