"""SGLang as the engine of a PDDeployment: owned flags, the protocol table, and the rules of each version.

Everything here is data read by the operator (admission, ``pdfleet render``, ``pdfleet matrix``):

- ``OWNED_FLAGS``: flags the operator renders from spec fields; a user's ``engine.args`` may not set them.
- ``PROTOCOLS``: ``spec.transfer.protocol`` x backend -> SGLang's transfer-backend flag and environment.
- ``RULES_0_5_23``: every SGLang 0.5.23 start-up rejection a PDDeployment can reach (``ServerArgs.
  resolve_once`` and its hooks), plus the failures SGLang meets only at transfer time, each with its
  reason and the SGLang file it comes from. tests/sglang runs the start-up ones through SGLang itself.

Pure: imports no SGLang (the wheel's flag set is a JSON file beside this module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdfleet_runtime.engine_rules.argv import ParsedArgs
from pdfleet_runtime.links import Backend, LinkProtocol
from pdfleet_runtime.roles import Role

__all__ = [
    "BOOTSTRAP_PORT",
    "DIST_INIT_PORT",
    "ENGINE_PORT",
    "MODEL_FAMILIES",
    "OWNED_FLAGS",
    "PROTOCOLS",
    "RULES",
    "STAGING_BUFFER_ENV",
    "EngineRule",
    "ModelFamily",
    "ProtocolSettings",
    "RoleView",
    "env_true",
]

ENGINE_PORT = 30000  # SGLang's HTTP port (its default), fixed so NetworkPolicy and the router can name it
BOOTSTRAP_PORT = 8998  # --disaggregation-bootstrap-port: the same on both roles (decode falls back to its own)
STAGING_BUFFER_ENV = "SGLANG_DISAGG_STAGING_BUFFER"
DIST_INIT_PORT = 5000  # --dist-init-addr's port on a replica group's first pod (torch.distributed's store)


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """What a layout preset is to SGLang: the ``architectures`` and ``model_type`` of its config.json
    (SGLang picks its model-specific start-up checks by the architecture)."""

    architecture: str
    model_type: str
    nested_text_config: bool = False  # multimodal wrappers keep the language model under text_config


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({
    "qwen3.8-flash-next": ModelFamily("Qwen4ExpForConditionalGeneration", "qwen4_exp", nested_text_config=True),
    "deepseek-mla": ModelFamily("DeepseekV3ForCausalLM", "deepseek_v3"),
    "llama-dense": ModelFamily("LlamaForCausalLM", "llama"),
    "qwen3-next-hybrid": ModelFamily("Qwen3NextForCausalLM", "qwen3_next"),
})


# dest -> the field that owns it ("{role}" is spec.prefill or spec.decode)
OWNED_FLAGS: Mapping[str, str] = MappingProxyType({
    "model_path": "spec.model.source",
    "revision": "spec.model.source.huggingFace.revision",
    "served_model_name": "spec.model.servedName",
    "tp_size": "{role}.parallelism.tensor",
    "pp_size": "{role}.parallelism.pipeline",
    "dp_size": "{role}.parallelism.data",
    "attn_dp_size": "{role}.parallelism.data",
    "enable_dp_attention": "{role}.parallelism.data",
    "ep_size": "{role}.parallelism.expert",
    "nnodes": "{role}.parallelism.nodesPerReplica",
    "node_rank": "the operator (each pod of a replica group gets its own)",
    "dist_init_addr": "the operator (the replica group's first pod)",
    "disaggregation_mode": "the role ({role})",
    "disaggregation_transfer_backend": "spec.transfer.backend",
    "disaggregation_bootstrap_port": "the operator (fixed: 8998 on both roles)",
    "disaggregation_ib_device": "spec.transfer.rdmaDevices / spec.transfer.rdmaDeviceMap",
    "host": "the operator (fixed: 0.0.0.0)",
    "port": "the operator (fixed: 30000)",
    "max_total_tokens": "{role}.pool.kvTokensPerReplica",
})


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    """What one (backend, protocol) pair renders to on an SGLang pod."""

    backend_flag: str  # --disaggregation-transfer-backend
    env: Mapping[str, str]
    ib_device: bool = False  # render --disaggregation-ib-device from rdmaDeviceMap / rdmaDevices
    per_gpu_devices: bool = True  # the connector reads SGLang's per-GPU JSON form (rdmaDeviceMap)
    host_ipc: bool = False
    note: str = ""


def _env(**kv: str) -> Mapping[str, str]:
    return MappingProxyType(kv)


PROTOCOLS: Mapping[tuple[Backend, LinkProtocol], ProtocolSettings] = MappingProxyType({
    (Backend.MOONCAKE, LinkProtocol.RDMA): ProtocolSettings(
        "mooncake", _env(), ib_device=True, note="devices from rdmaDeviceMap (per GPU) or rdmaDevices; "
        "none: Mooncake's auto-discovery"),
    (Backend.MOONCAKE, LinkProtocol.TCP): ProtocolSettings(
        "mooncake", _env(MC_FORCE_TCP="1"), note="what SGLang's own alias mooncake_tcp becomes"),
    (Backend.MOONCAKE, LinkProtocol.NVLINK): ProtocolSettings(
        "mooncake", _env(SGLANG_MOONCAKE_CUSTOM_MEM_POOL="INTRA_NODE_NVLINK", MC_INTRANODE_NVLINK="1"),
        host_ipc=True, note="GPUs of one host; without MC_INTRANODE_NVLINK Mooncake silently uses TCP"),
    (Backend.NIXL, LinkProtocol.RDMA): ProtocolSettings(
        "nixl", _env(), ib_device=True, note="the devices become UCX_NET_DEVICES per GPU"),
    (Backend.NIXL, LinkProtocol.TCP): ProtocolSettings("nixl", _env(UCX_TLS="tcp")),
    (Backend.NIXL, LinkProtocol.NVLINK): ProtocolSettings(
        "nixl", _env(UCX_TLS="cuda_ipc,cuda_copy,tcp"), host_ipc=True,
        note="tcp stays listed: NIXL's UCX backend needs an active-message lane"),
    (Backend.MORI, LinkProtocol.RDMA): ProtocolSettings(
        "mori", _env(), ib_device=True, per_gpu_devices=False,
        note="AMD GPUs with ROCm; the list becomes MORI_RDMA_DEVICES as written (no per-GPU map)"),
})


def env_true(value: str | None) -> bool:
    """SGLang's ``EnvBool``: true/1/yes/y (any case); anything else, or unset, is false."""
    return value is not None and value.lower() in ("true", "1", "yes", "y")


@dataclass(frozen=True)
class RoleView:
    """One role's engine as a rule reads it."""

    role: Role
    prefix: str  # "spec.prefill" or "spec.decode"
    args: ParsedArgs
    arg_paths: tuple[str, ...]  # the field path of each args element
    env: Mapping[str, str | None]  # effective environment (None: from a valueFrom, unknown here)
    env_paths: Mapping[str, str]
    tensor: int
    pipeline: int
    backend: Backend
    protocol: LinkProtocol
    model: str | None  # layout preset name (None: inline layout)
    state_types: frozenset[str]
    mla: bool
    peer_tensor: int  # the other role's TP (transfer-time rules pair both sizes)
    expert: int = 1  # parallelism.expert (rendered as --ep-size)

    def has(self, dest: str) -> bool:
        return bool(self.args.values.get(dest))

    def value(self, dest: str, default: object = None) -> object:
        return self.args.values.get(dest, default)

    def float_value(self, dest: str, default: float) -> float:
        value = self.args.values.get(dest, default)
        if not isinstance(value, str | int | float):
            return default  # a list (a tuple): no number (a bare flag, True, reads as 1.0 as before)
        try:
            return float(value)
        except ValueError:
            return default

    def flag_path(self, dest: str) -> str:
        at = self.args.where.get(dest)
        return self.arg_paths[at[0]] if at else f"{self.prefix}.engine.args"

    def env_path(self, name: str) -> str:
        return self.env_paths.get(name, f"{self.prefix}.engine.env")

    @property
    def family(self) -> ModelFamily | None:
        return MODEL_FAMILIES.get(self.model) if self.model else None


Finding = tuple[str, tuple[str, ...]]
"""A rule's finding: the message and the field paths it names."""


@dataclass(frozen=True, slots=True)
class EngineRule:
    """One SGLang rule: its id, why, the fix, the SGLang file, and when SGLang meets it.

    ``check(view) -> (message, paths) | None``; ``when`` is "start-up" (``ServerArgs.resolve_once``
    refuses the flags: the pod crash-loops) or "transfer" (the engine starts, every transfer fails)."""

    id: str
    title: str
    reason: str
    fix: str
    source: str
    when: str
    check: Callable[[RoleView], Finding | None]


_THRESHOLD = "disaggregation_decode_host_receive_threshold"
_SRC = "python/sglang/srt/"
_PD_HOOK = _SRC + "arg_groups/pd_disaggregation_hook.py"
_KV_HOOK = _SRC + "arg_groups/kv_cache_hook.py"
_VALIDATION = _SRC + "arg_groups/validation_hook.py"


def _qwen4_mori_pp(v: RoleView) -> Finding | None:
    fam = v.family
    if fam and fam.model_type == "qwen4_exp" and v.backend is Backend.MORI and v.pipeline > 1:
        return (f"{v.role}: Qwen4-Exp (qwen3.8-flash-next) with mori and PP {v.pipeline}",
                (f"{v.prefix}.parallelism.pipeline", "spec.transfer.backend"))
    return None


def _qwen4_unified(v: RoleView) -> Finding | None:
    fam = v.family
    if fam and fam.model_type == "qwen4_exp" and v.has("enable_unified_memory"):
        return (f"{v.role}: Qwen4-Exp does not support --enable-unified-memory",
                (v.flag_path("enable_unified_memory"), "spec.model.layout.preset"))
    return None


def _unified_pd(v: RoleView) -> Finding | None:
    if not v.has("enable_unified_memory"):
        return None
    if v.backend is not Backend.MOONCAKE:
        return (f"{v.role}: --enable-unified-memory with PD needs mooncake, got {v.backend}",
                (v.flag_path("enable_unified_memory"), "spec.transfer.backend"))
    if v.pipeline > 1:
        return (f"{v.role}: --enable-unified-memory with PD needs PP 1, got {v.pipeline}",
                (v.flag_path("enable_unified_memory"), f"{v.prefix}.parallelism.pipeline"))
    return None


def _prefill_complete(v: RoleView) -> Finding | None:
    if v.value("disaggregation_decode_allocation_policy") != "prefill_complete":
        return None
    why = []
    if v.backend is not Backend.MOONCAKE:
        why.append(f"backend {v.backend} (only mooncake)")
    if v.pipeline != 1:
        why.append(f"PP {v.pipeline} (only 1)")
    if v.tensor != 1:
        why.append(f"attention TP {v.tensor} (only 1)")
    if env_true(v.env.get(STAGING_BUFFER_ENV)):
        why.append("staging buffers")
    if v.has("enable_pd_role_switch"):
        why.append("--enable-pd-role-switch")
    if v.float_value(_THRESHOLD, 1.0) < 1:
        why.append("decode host KV buffering (host-receive threshold < 1)")
    if not why:
        return None
    return (f"{v.role}: --disaggregation-decode-allocation-policy prefill_complete does not support "
            + ", ".join(why),
            (v.flag_path("disaggregation_decode_allocation_policy"), f"{v.prefix}.parallelism.tensor"))


def _staging_backend(v: RoleView) -> Finding | None:
    if env_true(v.env.get(STAGING_BUFFER_ENV)) and v.backend not in (Backend.MOONCAKE, Backend.NIXL):
        return (f"{v.role}: {STAGING_BUFFER_ENV} needs mooncake or nixl, got {v.backend}",
                (v.env_path(STAGING_BUFFER_ENV), "spec.transfer.backend"))
    return None


def _role_switch(v: RoleView) -> Finding | None:
    if not v.has("enable_pd_role_switch"):
        return None
    why = []
    if v.pipeline > 1:
        why.append(f"PP {v.pipeline}")
    if v.expert > 1:
        why.append(f"expert parallelism {v.expert}")
    if v.value("speculative_algorithm") is not None:
        why.append(f"--speculative-algorithm {v.value('speculative_algorithm')}")
    if not why:
        return None
    return (f"{v.role}: --enable-pd-role-switch does not rebuild state for " + ", ".join(why),
            (v.flag_path("enable_pd_role_switch"), f"{v.prefix}.parallelism.pipeline",
             f"{v.prefix}.parallelism.expert"))


def _response_store(v: RoleView) -> Finding | None:
    if v.has("enable_response_store"):
        return (f"{v.role}: --enable-response-store is not supported in PD mode",
                (v.flag_path("enable_response_store"),))
    return None


def _watermark(v: RoleView) -> Finding | None:
    if v.has("enable_watermark"):
        return f"{v.role}: --enable-watermark is not supported with PD", (v.flag_path("enable_watermark"),)
    return None


def _host_receive_range(v: RoleView) -> Finding | None:
    t = v.float_value(_THRESHOLD, 1.0)
    if not 0 <= t <= 1:
        return f"{v.role}: --disaggregation-decode-host-receive-threshold {t:g} is outside [0, 1]", (
            v.flag_path(_THRESHOLD),)
    return None


def _host_pool(v: RoleView) -> bool:
    """Whether SGLang resolves the retraction backup to host_pool (given, or implied by a threshold < 1)."""
    return v.value("disaggregation_decode_retraction_backup") == "host_pool" or (
        0 <= v.float_value(_THRESHOLD, 1.0) < 1 and v.value("disaggregation_decode_retraction_backup") != "cpu_tensor")


def _host_receive_conflicts(v: RoleView) -> Finding | None:
    t = v.float_value(_THRESHOLD, 1.0)
    if not 0 <= t < 1:
        return None
    if v.has("enable_pd_role_switch"):
        return f"{v.role}: decode host receive (threshold {t:g}) does not support role switching", (
            v.flag_path(_THRESHOLD), v.flag_path("enable_pd_role_switch"))
    if v.value("disaggregation_decode_retraction_backup") == "cpu_tensor":
        return f"{v.role}: decode host receive (threshold {t:g}) needs host_pool retraction, not cpu_tensor", (
            v.flag_path(_THRESHOLD), v.flag_path("disaggregation_decode_retraction_backup"))
    return None


def _host_pool_prefill(v: RoleView) -> Finding | None:
    if v.role is Role.PREFILL and _host_pool(v):
        dest = ("disaggregation_decode_retraction_backup"
                if v.value("disaggregation_decode_retraction_backup") == "host_pool" else _THRESHOLD)
        return (f"prefill: host_pool retraction backup (from {v.args.where[dest][1]}) is only for decode; "
                "set it in spec.decode.engine.args", (v.flag_path(dest),))
    return None


def _offload_kvcache(v: RoleView) -> Finding | None:
    if not v.has("disaggregation_decode_enable_offload_kvcache"):
        return None
    if v.role is not Role.DECODE:
        why = "is only supported on decode"
    elif v.value("hicache_storage_backend") is None:
        why = "needs --hicache-storage-backend"
    elif _host_pool(v):
        why = "excludes host_pool retraction"
    else:
        return None
    return (f"{v.role}: --disaggregation-decode-enable-offload-kvcache {why}",
            (v.flag_path("disaggregation_decode_enable_offload_kvcache"),))


def _hetero_tp(states: frozenset[str], backend: Backend, title: str,
               mla_ok: bool = False) -> Callable[[RoleView], Finding | None]:
    """A transfer-time rule: ``backend`` cannot move ``states`` across different TP sizes (``mla_ok``:
    except on an MLA model, whose latent state is replicated)."""
    def check(v: RoleView) -> Finding | None:
        # checked once, on decode (the receiving side names both TP sizes)
        if v.role is not Role.DECODE or v.backend is not backend or not (v.state_types & states):
            return None
        if mla_ok and v.mla:
            return None
        prefill_tp = v.peer_tensor
        if prefill_tp == v.tensor:
            return None
        return (f"{backend} {title} across TP {prefill_tp} -> {v.tensor}",
                ("spec.prefill.parallelism.tensor", "spec.decode.parallelism.tensor", "spec.transfer.backend"))
    return check


def _rule(id: str, title: str, reason: str, fix: str, source: str, check: Callable[[RoleView], Finding | None],
          when: str = "start-up") -> EngineRule:
    return EngineRule(f"sglang.{id}", title, reason, fix, source, when, check)


_PLE = frozenset({"ple_short_conv", "ple_ngram"})
_QSA = frozenset({"qsa_pending", "qsa_compressed"})
_MAMBA = frozenset({"mamba"})

RULES_0_5_23: tuple[EngineRule, ...] = (
    _rule("qwen4-exp-mori-pp", "Qwen3.8 Flash Next (Qwen4-Exp) on MORI needs PP 1",
          "MORI does not exchange the global QSA layer metadata needed to pair compact state descriptors "
          "across pipeline stages",
          "set parallelism.pipeline to 1 in both roles, or use mooncake",
          _SRC + "arg_groups/model_overrides/qwen4_exp.py", _qwen4_mori_pp),
    _rule("qwen4-exp-unified-memory", "Qwen3.8 Flash Next (Qwen4-Exp) has no unified memory pool",
          "SGLang's Qwen4-Exp overrides refuse --enable-unified-memory", "remove --enable-unified-memory",
          _SRC + "arg_groups/model_overrides/qwen4_exp.py", _qwen4_unified),
    _rule("unified-memory-pd", "--enable-unified-memory in PD needs mooncake and PP 1",
          "the whole-envelope transfer of the unified pool is built for Mooncake only and has no per-layer "
          "entries to subset across pipeline stages", "use mooncake with PP 1, or remove --enable-unified-memory",
          _KV_HOOK, _unified_pd),
    _rule("prefill-complete-allocation", "prefill_complete allocation needs mooncake, PP 1 and attention TP 1",
          "--disaggregation-decode-allocation-policy prefill_complete is built only for Mooncake without "
          "pipeline or attention tensor parallelism, staging buffers, role switching or decode host buffering",
          "use the default allocation policy (early), or mooncake with parallelism.tensor 1 and pipeline 1",
          _PD_HOOK, _prefill_complete),
    _rule("staging-buffer-backend", "SGLang's staging buffer needs mooncake or nixl",
          f"{STAGING_BUFFER_ENV} stages KV through a buffer only the Mooncake and NIXL connectors implement",
          "unset spec.engine.stagingBuffer (and the variable), or use mooncake or nixl",
          _PD_HOOK, _staging_backend),
    _rule("role-switch", "--enable-pd-role-switch excludes PP > 1, expert parallelism and speculation",
          "a role flip does not rebuild role-specific state for these features",
          "remove --enable-pd-role-switch, or use PP 1, parallelism.expert 1 and no --speculative-algorithm",
          _PD_HOOK, _role_switch),
    _rule("response-store-pd", "--enable-response-store is not supported in PD mode",
          "response storage must stay disabled on PD prefill and decode servers",
          "remove --enable-response-store", _VALIDATION, _response_store),
    _rule("watermark-pd", "--enable-watermark is not supported in PD mode",
          "SGLang's watermarking is not implemented for disaggregated serving",
          "remove --enable-watermark", _VALIDATION, _watermark),
    _rule("host-receive-threshold-range", "--disaggregation-decode-host-receive-threshold must be in [0, 1]",
          "it is a fraction of the decode KV pool", "set it between 0 and 1", _PD_HOOK, _host_receive_range),
    _rule("host-receive-conflicts", "decode host receive excludes role switching and cpu_tensor retraction",
          "a threshold below 1 buffers KV in a decode host pool that role switching does not rebuild and "
          "cpu_tensor retraction does not provide", "raise the threshold to 1, or drop the conflicting flag",
          _PD_HOOK, _host_receive_conflicts),
    _rule("host-pool-on-prefill", "host_pool retraction (or a host-receive threshold < 1) is decode-only",
          "SGLang builds the decode host pool only on a decode server; set in spec.engine.args the flag "
          "reaches the prefill too", "move the flag to spec.decode.engine.args", _KV_HOOK, _host_pool_prefill),
    _rule("decode-offload-kvcache", "--disaggregation-decode-enable-offload-kvcache: decode only, with storage",
          "the decode KV offload writes to a HiCache storage backend and builds its own host pool",
          "move it to spec.decode.engine.args with --hicache-storage-backend, and no host_pool retraction",
          _KV_HOOK, _offload_kvcache),
    _rule("nixl-ple-hetero-tp", "NIXL: no replicated PLE state across TP sizes",
          "SGLang's NIXL sender does not elect one writer for replicated linear-state siblings (PLE) when "
          "prefill and decode TP differ; the engines start and every transfer of such a request fails",
          "use equal prefill and decode TP, or mooncake", _SRC + "disaggregation/nixl/conn.py",
          _hetero_tp(_PLE, Backend.NIXL, "cannot move replicated PLE state"), when="transfer"),
    _rule("nixl-qsa-hetero-tp-mha", "NIXL: no QSA state across TP sizes on a non-MLA model",
          "SGLang's NIXL connector raises 'PD Disaggregation does NOT support PD different TP sizes for "
          "non-MLA QSA hybrid models' at the first transfer", "use equal prefill and decode TP, or mooncake",
          _SRC + "disaggregation/nixl/conn.py",
          _hetero_tp(_QSA, Backend.NIXL, "cannot move QSA state of a non-MLA model", mla_ok=True), when="transfer"),
    _rule("mori-qsa-hetero-tp", "MORI: no QSA state across TP sizes",
          "SGLang's MORI connector raises 'heterogeneous TP not supported' for QSA state at transfer time",
          "use equal prefill and decode TP, or mooncake", _SRC + "disaggregation/mori/conn.py",
          _hetero_tp(_QSA, Backend.MORI, "cannot move QSA state"), when="transfer"),
    _rule("mori-mamba-hetero-tp", "MORI: no replicated Mamba state across TP sizes",
          "SGLang's MORI connector requires matching attention TP for replicated Mamba state",
          "use equal prefill and decode TP, or mooncake", _SRC + "disaggregation/mori/conn.py",
          _hetero_tp(_MAMBA, Backend.MORI, "cannot move replicated Mamba state"), when="transfer"),
)

RULES: Mapping[str, tuple[EngineRule, ...]] = MappingProxyType({"0.5.23": RULES_0_5_23})
"""Rules per SGLang version; a version is known iff it has rules and a flag set."""
