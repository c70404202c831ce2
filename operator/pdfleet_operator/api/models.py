"""The PDDeployment spec and status: the source of truth for ``crds/`` and for validation.

Every field has a description (it is the ``kubectl explain`` text) and a default unless the user
must choose: the layout, the backend, and each role's ``replicas``, ``parallelism.tensor`` and
``image``. Object-valued fields with defaults carry their full default value in the CRD, so a stored object
shows the effective values.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import AwareDatetime, Field, StringConstraints

from pdfleet_operator.api.autoscaling import AutoscalingSpec, AutoscalingStatus
from pdfleet_operator.api.constants import API_VERSION, KIND, ConditionStatus, ConditionType, RolloutPhase
from pdfleet_operator.api.kube import PRESERVE, ApiModel, EnvVar, ResourceRequirements, Toleration
from pdfleet_operator.api.scheduling import SchedulingSpec
from pdfleet_runtime.config import SERVED_NAME_PATTERN
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.links import Backend, LinkProtocol
from pdfleet_runtime.versions import CURRENT_RUNTIME_VERSION, RUNTIME_VERSION_PATTERN

__all__ = [
    "DEFAULT_GPU_MEMORY_GIB",
    "AutoscalingSpec",
    "Condition",
    "EngineKind",
    "EngineOverride",
    "EngineSpec",
    "HuggingFaceSource",
    "ModelSource",
    "ModelSpec",
    "ModelStatus",
    "PDDeployment",
    "PDDeploymentSpec",
    "PDDeploymentStatus",
    "Parallelism",
    "PoolSpec",
    "RoleRollout",
    "RoleSpec",
    "RoleStatus",
    "RolloutSpec",
    "RolloutStatus",
    "RouterKind",
    "RouterPolicy",
    "RouterSpec",
    "SchedulingSpec",
    "TransferSpec",
    "shapes_text",
]

DEFAULT_GPU_MEMORY_GIB = 141.0  # H200


def _defaults_of(model: type[ApiModel]) -> dict[str, Any]:
    """The CRD default of an object field: its full default value. The apiserver checks a default
    against the CEL rules without filling nested defaults first, so ``{}`` would not do."""
    return {"default": model().model_dump(by_alias=True, exclude_none=True, mode="json")}


# An int (pods) or a percentage of the role's replicas, as in a Deployment's rolling update.
IntOrPercent = int | Annotated[str, StringConstraints(pattern=r"^(100|[1-9]?[0-9])%$", max_length=4)]


EngineArg = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
_ENGINE_VERSION = r"^[0-9]+\.[0-9]+\.[0-9]+([.-][0-9A-Za-z.-]+)?$"


class EngineKind(StrEnum):
    PDFLEET = "pdfleet"  # the built-in runtime (the reference runtime for tests and benchmarks)
    SGLANG = "sglang"
    VLLM = "vllm"  # vLLM's `vllm serve` (docs/vllm.md)


class EngineSpec(ApiModel):
    """The inference engine each prefill and decode pod runs, beside the pdfleet agent."""

    kind: EngineKind = Field(
        EngineKind.PDFLEET,
        description="pdfleet (default: the built-in runtime, no engine container), sglang or vllm.",
    )
    version: Annotated[str, StringConstraints(pattern=_ENGINE_VERSION, max_length=64)] | None = Field(
        None,
        description="Engine version inside the image, e.g. 0.5.23 (sglang) or 0.33.0 (vllm); keys the engine's "
        "rules and flag set. Required for sglang and vllm; unknown versions are denied, listing the known ones.",
    )
    image: str | None = Field(
        None, min_length=1, max_length=1024,
        description="Engine container image, e.g. lmsysorg/sglang:v0.5.23 or vllm/vllm-openai:v0.33.0. Required for "
        "sglang and vllm.",
    )
    args: list[EngineArg] | None = Field(
        None, max_length=256,
        description="Extra engine flags for both roles, e.g. [--mem-fraction-static, '0.85']. Flags the "
        "operator renders from spec fields (TP/PP/DP sizes, disaggregation mode, transfer backend, "
        "bootstrap port, IB device, host, port, model path, served name) are denied, as are flags the "
        "engine version does not have.",
    )
    env: list[EnvVar] | None = Field(
        None, max_length=256, description="Extra environment of the engine container (both roles)."
    )
    staging_buffer: bool = Field(
        False,
        description="Use SGLang's own KV staging buffer (SGLANG_DISAGG_STAGING_BUFFER=1); mooncake and "
        "nixl only.",
    )


class EngineOverride(ApiModel):
    """Per-role engine settings: each field set here replaces (image, version) or extends (args, env)
    spec.engine's for this role, so a decode-only engine upgrade is one field."""

    image: str | None = Field(None, min_length=1, max_length=1024, description="Engine image of this role.")
    version: Annotated[str, StringConstraints(pattern=_ENGINE_VERSION, max_length=64)] | None = Field(
        None, description="Engine version of this role (keys its rules and flag set)."
    )
    args: list[EngineArg] | None = Field(
        None, max_length=256, description="Flags added after spec.engine.args for this role only."
    )
    env: list[EnvVar] | None = Field(
        None, max_length=256, description="Environment added after spec.engine.env for this role only."
    )


class HuggingFaceSource(ApiModel):
    """A model downloaded from the Hugging Face Hub when the engine starts."""

    id: str = Field(
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        description="Repository id, e.g. Qwen/Qwen3.8-Flash-Next.",
    )
    token_secret: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Secret in the deployment's namespace whose key `token` holds the Hub token (HF_TOKEN).",
    )
    revision: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="The commit every pod loads (the engines' --revision): a full 40-hex commit hash, or a "
        "branch or tag that the operator resolves once to a commit recorded in status.model and never "
        "re-resolves while this field keeps its value. Prefill and decode load the same weights, and a new "
        "commit is a rollout of both roles. Unset: each pod loads whatever the default branch holds when it "
        "starts (admitted with a warning; the built-in runtime needs it).",
    )
    endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=500,
        description="The Hub the pods download from: a mirror, or another server speaking the Hub's API "
        "(the engines' HF_ENDPOINT). Unset: https://huggingface.co. Branches and tags are resolved by the "
        "operator's own --hub-endpoint.",
    )
    cache: dict[str, Any] | None = Field(
        None,
        json_schema_extra=PRESERVE,
        description="The node's weights cache: a core/v1 volume source the pods of a node share, writable by "
        "the pods' user, e.g. {hostPath: {path: /var/lib/pdfleet/weights, type: DirectoryOrCreate}}. The "
        "built-in runtime fetches each commit into it once per node, checked against the Hub's file hashes, "
        "so a restart downloads nothing (required there); SGLang and vLLM pods use it as their Hugging Face "
        "cache (HF_HUB_CACHE). Unset for an engine: each pod downloads into its own emptyDir.",
    )


class ModelSource(ApiModel):
    """Where the engine reads the weights: a path in the pod (with the volume holding it), or the Hub."""

    path: str | None = Field(
        None, min_length=2, max_length=1024, pattern=r"^/",
        description="Absolute path of the model directory in the engine container (--model-path).",
    )
    volume: dict[str, Any] | None = Field(
        None,
        json_schema_extra=PRESERVE,
        description="A core/v1 volume source (persistentVolumeClaim, hostPath, image, ...) mounted "
        "read-only at path; omit it when the image holds the model.",
    )
    digest: str | None = Field(
        None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="The directory's content digest (`pdfleet digest DIR`): the built-in runtime refuses to start "
        "on other content, and it is part of both roles' revision and of the compatibility key. Goes with path.",
    )
    hugging_face: HuggingFaceSource | None = Field(
        None,
        alias="huggingFace",
        description="Download from the Hugging Face Hub at start (allowed, with a warning: every pod "
        "downloads the weights).",
    )


class ModelSpec(ApiModel):
    """The model being served: what request state each rank keeps."""

    layout: LayoutRef = Field(
        description="The model's state layout: {preset: NAME} for a built-in preset, or {inline: {...}} "
        "for a layout given in full. It decides which state types move and which shapes are legal."
    )
    served_name: str | None = Field(
        None, min_length=1, max_length=256, pattern=SERVED_NAME_PATTERN,
        description="Model name clients send (--served-model-name); default: the deployment's name.",
    )
    source: ModelSource | None = Field(
        None, description="Where the engine reads the weights; required for an engine other than pdfleet."
    )


class TransferSpec(ApiModel):
    """How request state moves from prefill ranks to decode ranks."""

    backend: Backend = Field(
        description="Transfer engine: mooncake (all state types, heterogeneous TP, PP), nixl (no PLE "
        "or non-MLA QSA across TP sizes), or mori (AMD; no QSA with PP > 1 or across TP sizes, no PLE "
        "across TP sizes). `pdfleet matrix` prints every cell with its reason."
    )
    protocol: LinkProtocol = Field(
        LinkProtocol.RDMA,
        description="The link to use; each backend maps it to its engine settings: rdma (default; across "
        "nodes), tcp (slow, for tests), nvlink (GPUs of one host; grants hostIPC), shm (host memory of "
        "one host).",
    )
    rdma_devices: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] | None = Field(
        None,
        max_length=16,
        description="RDMA device names (e.g. mlx5_0) for protocol rdma, used by every GPU; empty lets the "
        "engine discover them.",
    )
    rdma_device_map: dict[str, list[Annotated[str, StringConstraints(min_length=1, max_length=64)]]] | None = (
        Field(
            None,
            json_schema_extra={"maxProperties": 64},
            description="Per-GPU RDMA devices for protocol rdma: GPU index within the pod ('0', '1', ...) -> "
            "device names, e.g. {'0': [mlx5_0], '1': [mlx5_1]}. Rendered as SGLang's per-GPU JSON "
            "--disaggregation-ib-device. Exclusive with rdmaDevices.",
        )
    )
    canary_period_seconds: int | None = Field(
        None, ge=1, le=3600,
        description="How often a ready pod re-proves its transfer path: each decode pod sends a canary through every "
        "prefill pod it discovers, this often (a pod that is not ready retries every second). A decode whose canaries "
        "fail against most prefill pods (two at least) leaves the routers; one failing pair is reported. Unset: the "
        "runtime's default, 10. Lower finds a broken path sooner, at one small transfer per pair and period.",
    )
    rdma_resource: Annotated[str, StringConstraints(
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", max_length=253
    )] = Field(
        "rdma/rdma_shared_device_a",
        description="Extended resource of the cluster's RDMA device plugin, one per pod, requested only for "
        "protocol rdma (with the IPC_LOCK capability). Default rdma/rdma_shared_device_a "
        "(k8s-rdma-shared-dev-plugin); set it to what your plugin advertises.",
    )


class Parallelism(ApiModel):
    """How one replica of a role is split across GPUs: tensor x pipeline GPUs, with attention data and
    expert parallelism nested inside TP as SGLang 0.5.23 defines them (docs/parallelism.md)."""

    tensor: int = Field(
        ge=1,
        le=64,
        description="Tensor-parallel size (GPUs sharing each layer). Prefill and decode sizes must divide "
        "one another, and must divide (or be a multiple of) the model's KV heads.",
    )
    pipeline: int = Field(
        1,
        ge=1,
        le=64,
        description="Pipeline-parallel stages; default 1. Decode must use the prefill's value or 1.",
    )
    data: int = Field(
        1,
        ge=1,
        le=64,
        description="Attention data parallelism (SGLang --attn-dp-size): the TP ranks split into `data` groups "
        "that each run attention on their own requests with tensor/data ranks (1 per group at data = tensor, "
        "as DeepSeek MLA deployments do); the MoE and dense layers still span all TP ranks. Must divide "
        "tensor. Default 1. Needs spec.engine.kind sglang or vllm (the built-in runtime has none; vLLM: docs/vllm.md).",
    )
    expert: int = Field(
        1,
        ge=1,
        le=64,
        description="Expert parallelism (SGLang --ep-size): MoE experts are spread over `expert` ranks, each "
        "expert split over tensor/expert ranks (expert = tensor: whole experts per rank). Must divide tensor. "
        "Default 1. Needs spec.engine.kind sglang or vllm (the built-in runtime has none; vLLM: docs/vllm.md).",
    )
    nodes_per_replica: int = Field(
        1,
        ge=1,
        le=64,
        description="Nodes one replica spans: a group of nodesPerReplica pods, one per node, each with "
        "tensor x pipeline / nodesPerReplica GPUs (SGLang --nnodes/--node-rank/--dist-init-addr), created, "
        "drained and restarted as a unit; only the first pod serves HTTP and is routed to. Must divide "
        "tensor x pipeline. Default 1.",
    )


    @property
    def gpus_per_pod(self) -> int:
        """GPUs of one pod of a replica: tensor x pipeline over nodesPerReplica (admission checks it divides)."""
        return max(1, self.tensor * self.pipeline // self.nodes_per_replica)


class PoolSpec(ApiModel):
    """Capacity of one replica's state pools, allocated on every rank at start."""

    max_concurrent_requests: int = Field(
        64,
        ge=1,
        le=65536,
        description="Requests a replica holds state for at once (slots and rows); default 64.",
    )
    kv_tokens_per_replica: int = Field(
        131072,
        ge=1,
        le=1 << 30,
        description="KV tokens a replica holds over all its requests (pages = tokens / pageSize + requests); "
        "default 131072. Pools must fit gpuMemoryGiB.",
    )


class RoleSpec(ApiModel):
    """One role (prefill or decode): its replicas, shape, image and pod settings."""

    replicas: int = Field(ge=0, le=4096, description="Number of replicas (each is tensor x pipeline GPUs).")
    parallelism: Parallelism = Field(description="How a replica splits across GPUs.")
    image: str = Field(min_length=1, max_length=1024, description="Container image of the pdfleet runtime.")
    runtime_version: str = Field(
        CURRENT_RUNTIME_VERSION,
        pattern=RUNTIME_VERSION_PATTERN,
        max_length=64,
        description="pdfleet runtime version inside the image; picks the capability matrix and wire protocol. "
        f"Default {CURRENT_RUNTIME_VERSION}.",
    )
    pool: PoolSpec = Field(
        default_factory=PoolSpec,
        json_schema_extra=_defaults_of(PoolSpec),
        description="Pool capacity per replica.",
    )
    gpu_memory_gib: float = Field(
        DEFAULT_GPU_MEMORY_GIB,
        alias="gpuMemoryGiB",
        ge=1,
        le=4096,
        description="Memory of one GPU in GiB, used to check that the pools fit; default 141 (H200).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        json_schema_extra=_defaults_of(ResourceRequirements),
        description="CPU and memory of the runtime container; GPUs come from the parallelism.",
    )
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] | None = Field(
        None, description="Node labels the role's pods must match."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=64, description="Tolerations of the role's pods."
    )
    affinity: dict[str, Any] | None = Field(
        None,
        json_schema_extra=PRESERVE,
        description="A core/v1 Affinity for the role's pods, passed through.",
    )
    env: list[EnvVar] | None = Field(
        None, max_length=256, description="Extra environment of the runtime container."
    )
    engine: EngineOverride | None = Field(
        None, description="This role's engine overrides (image, version, args, env) of spec.engine."
    )
    scaling_adapter: bool = Field(
        False,
        description="Drive this role's count from outside (an HPA or KEDA): the operator makes a PDRoleScale "
        "<deployment>-<role> with a scale subresource and takes the count from it. Not with spec.autoscaling "
        "(docs/autoscaling.md). Default false.",
    )


class RolloutSpec(ApiModel):
    """How a changed spec rolls out (decode and prefill alike); see docs on canaries and drains."""

    max_surge: IntOrPercent = Field(
        1,
        description="Pods above the replica count during a rollout: an int or a percentage (rounded up). "
        "Default 1. Draining pods count: they still hold GPUs.",
    )
    max_unavailable: IntOrPercent = Field(
        0,
        description="Ready pods that may be missing during a rollout: an int or a percentage (rounded "
        "down). Default 0. maxSurge and maxUnavailable may not both be 0.",
    )
    drain_timeout_seconds: int = Field(
        600,
        ge=0,
        le=86400,
        description="How long a drain waits for in-flight requests and transfers before deleting the pod "
        "(recorded as forced); default 600.",
    )
    progress_deadline_seconds: int = Field(
        900,
        ge=1,
        le=604800,
        description="A rollout without progress for this long is marked failed and rolled back; default "
        "900. Must exceed drainTimeoutSeconds.",
    )
    canary_replicas: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="The most decode pods on a new revision until raised or cleared; the rollout holds "
        "there. Unset: no canary hold.",
    )
    paused: bool = Field(False, description="Pause the rollout: committed drains finish, nothing new starts.")


class RouterKind(StrEnum):
    """Which router fronts the fleet: each speaks its own engine's PD request protocol."""

    SGLANG = "sglang"  # sglang-router 0.3.2: SGLang's bootstrap fields (the built-in runtime speaks them too)
    VLLM = "vllm"  # vllm-router 0.1.17: vLLM's kv_transfer_params (docs/vllm.md)


class RouterPolicy(StrEnum):
    """Load-balancing policies both routers have (``--prefill-policy``/``--decode-policy``)."""

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    CACHE_AWARE = "cache_aware"
    POWER_OF_TWO = "power_of_two"


class RouterSpec(ApiModel):
    """The deployment's endpoint: stateless sglang-router pods that pick a prefill and a decode pod
    per request, discovering them through the Kubernetes API (get/list/watch on pods only)."""

    kind: RouterKind | None = Field(
        None,
        description="sglang (sglang-router 0.3.2) or vllm (vllm-router 0.1.17); default: the engine's own "
        "router (vllm for spec.engine.kind vllm, sglang otherwise). A router of the other engine is denied: "
        "it sends fields the engines ignore, so no state moves and nothing fails.",
    )
    replicas: int = Field(1, ge=0, le=64, description="Router pods (stateless); default 1.")
    image: str = Field(
        min_length=1, max_length=1024,
        description="Container image of the router and of pdfleet's front (both run from it): pdfleet-runtime "
        "and the router, sglang-router==0.3.2 or vllm-router==0.1.17 (e.g. the pdfleet runtime image with the "
        "router extra, which holds both).",
    )
    prefill_policy: RouterPolicy = Field(
        RouterPolicy.CACHE_AWARE,
        description="How the router picks a prefill pod: random, round_robin, cache_aware (default, the "
        "router's own) or power_of_two.",
    )
    decode_policy: RouterPolicy = Field(
        RouterPolicy.ROUND_ROBIN,
        description="How the router picks a decode pod: random, round_robin (default), cache_aware or "
        "power_of_two (needs two or more decode pods).",
    )
    port: int = Field(
        30000, ge=1, le=65535, description="Port of the router and of the endpoint Service; default 30000."
    )
    metrics_port: int = Field(
        29000, ge=1, le=65535, description="Port of the router's Prometheus metrics; default 29000."
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        json_schema_extra=_defaults_of(ResourceRequirements),
        description="CPU and memory of the router container.",
    )


class PDDeploymentSpec(ApiModel):
    """A prefill/decode disaggregated serving fleet of one model."""

    model: ModelSpec = Field(description="The model being served.")
    engine: EngineSpec | None = Field(
        None,
        description="The inference engine; absent: kind pdfleet, the built-in runtime. For sglang the role's "
        "image, runtimeVersion, env and resources belong to the pdfleet agent container beside the engine.",
    )
    transfer: TransferSpec = Field(description="Transfer backend and protocol between prefill and decode.")
    prefill: RoleSpec = Field(description="The prefill role: computes prompts and sends their state.")
    decode: RoleSpec = Field(description="The decode role: receives state and generates tokens.")
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        json_schema_extra=_defaults_of(RolloutSpec),
        description="How changes roll out.",
    )
    router: RouterSpec | None = Field(
        None,
        description="The deployment's endpoint: sglang-router pods behind a Service (status.endpoint). "
        "Absent: no router, clients reach no endpoint.",
    )
    # -- autoscaling (issue 48; the models live in api/autoscaling.py) --
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Autoscale both roles on PD signals within bounds, a prefill:decode ratio band and a GPU "
        "budget (docs/autoscaling.md). Absent: each role keeps spec.<role>.replicas.",
    )
    # -- gang scheduling and topology packing of replica groups (issue 49; api/scheduling.py) --
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,
        json_schema_extra=_defaults_of(SchedulingSpec),
        description="How replica groups are placed: gang admission (none, or Kueue with its LocalQueue) and a "
        "node label every member of a group shares (docs/parallelism.md). Default: no gang, no topology key.",
    )


# -- status ----------------------------------------------------------------------------------------


class Condition(ApiModel):
    """A metav1.Condition."""

    type: ConditionType = Field(description="Admitted, Progressing, Available or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(None, ge=0, description="The generation this condition is about.")
    last_transition_time: AwareDatetime | None = Field(None, description="When status last changed.")
    reason: str | None = Field(None, max_length=1024, description="CamelCase reason, e.g. the matrix rule.")
    message: str | None = Field(None, max_length=32768, description="Human-readable details.")


class RoleStatus(ApiModel):
    """Pod counts of one role."""

    replicas: int = Field(0, ge=0, description="Pods of the role, all revisions.")
    ready: int = Field(0, ge=0, description="Pods that passed the transfer-path readiness gate.")
    updated: int = Field(0, ge=0, description="Pods on the current revision.")
    selector: str | None = Field(None, description="Label selector of the role's pods (scale subresource).")


class RoleRollout(ApiModel):
    """One role's rollout: which revision it runs, rolls to, trusts and refuses."""

    current_revision: str | None = Field(None, description="Revision of the role in the spec now.")
    target_revision: str | None = Field(
        None, description="Revision the role's pods roll to: the current one, or the stable one while rolling back."
    )
    stable_revision: str | None = Field(
        None, description="Last revision whose rollout completed (written last: the commit point)."
    )
    failed_revisions: list[str] | None = Field(
        None, max_length=64, description="Revisions marked failed; not tried again until the spec changes."
    )
    updated: int = Field(0, ge=0, description="Pods on the target revision.")
    ready: int = Field(0, ge=0, description="Routable ready pods (transfer-path gate True, not draining).")
    draining: int = Field(0, ge=0, description="Pods draining in-flight transfers before they go.")
    last_progress_time: AwareDatetime | None = Field(
        None, description="When the rollout last made progress (a target pod ready, or a drain finished)."
    )
    failure_reason: str | None = Field(
        None, max_length=4096, description="Why the spec's revision was marked failed (kept while it stays failed)."
    )
    progress: str | None = Field(
        None, description="Target pods ready / pods of other revisions (and the target's gangs Kueue has not "
        "admitted), as of the last pass; a change is progress."
    )
    message: str | None = Field(None, max_length=32768, description="Why the role's rollout is where it is.")


class RolloutStatus(ApiModel):
    """Where the rollout stands, per role; state lives here and on the pods, never in memory."""

    phase: RolloutPhase = Field(
        RolloutPhase.IDLE,
        description="Idle, Progressing, CanaryHold, Paused, RollingBack, Failed or Complete.",
    )
    message: str | None = Field(None, max_length=32768, description="Why the rollout is where it is.")
    prefill: RoleRollout | None = Field(None, description="The prefill role's rollout.")
    decode: RoleRollout | None = Field(None, description="The decode role's rollout.")


class ModelStatus(ApiModel):
    """The commit a Hub branch or tag was resolved to, once (model_ref.py): what every pod renders."""

    id: str = Field(description="huggingFace.id it was resolved for.")
    requested: str = Field(description="huggingFace.revision as written (a branch or tag).")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="The commit the pods load (--revision).")
    resolved_at: str = Field(description="When the Hub was asked (RFC 3339).")


class PDDeploymentStatus(ApiModel):
    """Observed state, written by the operator through the status subresource."""

    observed_generation: int | None = Field(None, ge=0, description="The spec generation last reconciled.")
    conditions: list[Condition] | None = Field(
        None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Admitted, Progressing, Available, Degraded.",
    )
    prefill: RoleStatus | None = Field(None, description="Prefill pod counts.")
    decode: RoleStatus | None = Field(None, description="Decode pod counts.")
    prefill_ready: str | None = Field(
        None, description="Ready/desired prefill pods, e.g. 2/2 (printer column)."
    )
    decode_ready: str | None = Field(
        None, description="Ready/desired decode pods, e.g. 3/4 (printer column)."
    )
    shapes: str | None = Field(None, description="Shapes of both roles, e.g. P tp4xpp1 / D tp2xpp1.")
    matrix_version: str | None = Field(
        None, description="Capability matrix version the spec was admitted by."
    )
    rollout: RolloutStatus | None = Field(None, description="The rollout's state.")
    endpoint: str | None = Field(
        None, description="URL of the router Service clients send OpenAI requests to (printer column)."
    )
    autoscaling: AutoscalingStatus | None = Field(
        None, description="The autoscaler's latest decision per role: desired, reason, the signal values "
        "(spec.autoscaling set only; docs/autoscaling.md)."
    )
    model: ModelStatus | None = Field(
        None, description="The commit spec.model.source.huggingFace.revision (a branch or tag) was resolved to; "
        "unset for a commit, a path source, or a name not resolved yet."
    )


class PDDeployment(ApiModel):
    """A whole PDDeployment object as the operator reads it."""

    api_version: str = Field(API_VERSION, description="pdfleet.io/v1alpha1.")
    kind: str = Field(KIND, description="PDDeployment.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: PDDeploymentSpec
    status: PDDeploymentStatus | None = None


def shapes_text(spec: PDDeploymentSpec) -> str:
    """The printer column text, e.g. ``P tp4xpp1 / D tp2xpp1``."""
    p, d = spec.prefill.parallelism, spec.decode.parallelism
    return f"P tp{p.tensor}xpp{p.pipeline} / D tp{d.tensor}xpp{d.pipeline}"
