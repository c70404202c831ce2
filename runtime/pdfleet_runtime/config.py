"""The runtime's configuration: what the operator writes and `pdfleet-runtime serve` reads.

One pydantic model shared by both sides, so the operator cannot write a file the runtime
does not understand. Pure (pydantic only): the operator imports it. The file is YAML (or
JSON) mounted from the role's ConfigMap; the authentication secret is never in it, only the
path of the mounted Secret file.

Ports are fixed (not chosen at run time) so a NetworkPolicy can scope them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.links import Backend, LinkProtocol
from pdfleet_runtime.model.hub_cache import snapshot_dir
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.roles import Role

__all__ = [
    "ADMIN_PORT",
    "BOOTSTRAP_PORT",
    "CONFIG_SCHEMA_VERSION",
    "DRAINED_CONDITION",
    "DRAIN_ANNOTATION",
    "ENGINE_PORT",
    "GROUP_LEADER_ENV",
    "GROUP_MEMBER_ENV",
    "GROUP_PORT",
    "HTTP_PORT",
    "METRICS_PORT",
    "READINESS_GATE",
    "SERVED_NAME_PATTERN",
    "SILENT_FALLBACK_CONDITION",
    "ComputeCost",
    "ConfigError",
    "GroupConfig",
    "HubSourceConfig",
    "ModelSourceConfig",
    "Role",
    "RuntimeConfig",
    "StagingConfig",
    "drain_of",
    "drained_message",
    "load_config",
]

CONFIG_SCHEMA_VERSION = 1
HTTP_PORT = 8080  # /healthz, /readyz, /metrics, the worker API
METRICS_PORT = 8090  # /metrics alone: a scraper needs no route to the worker API (docs/monitoring.md)
ADMIN_PORT = 8081  # POST|DELETE /drain, on 127.0.0.1 only: the exec preStop hook (``pdfleet-runtime drain``)
BOOTSTRAP_PORT = 8998  # prefill only: where decode ranks register and send requests
ENGINE_PORT = 17000  # first engine port; rank r of a pod uses ENGINE_PORT + r
GROUP_PORT = 8997  # replica groups (nodesPerReplica > 1): ranks of one replica across its pods, same role only
# Per pod of a replica group (the operator sets them; the ConfigMap is the role's, shared by every member):
GROUP_MEMBER_ENV = "PDFLEET_GROUP_MEMBER"  # this pod's place in its group, 0 = the leader (serves HTTP)
GROUP_LEADER_ENV = "PDFLEET_GROUP_LEADER"  # the leader's pod name; DNS <leader>.<group.service>.<ns>.svc
# The pod condition set after a verified canary transfer; its reasons, and which of them fail a rollout,
# are readiness_problems' (Problem, GATE_FAILURES).
READINESS_GATE = "pdfleet.io/transfer-path"
SERVED_NAME_PATTERN = r"^[A-Za-z0-9._:/@+-]+$"  # spec.model.servedName, checked at admission too
DRAIN_ANNOTATION = "pdfleet.io/drain-started"  # set by the operator (epoch seconds): stop admitting, drain
DRAINED_CONDITION = "pdfleet.io/drained"  # set by the runtime once a drained pod has nothing in flight
# True while the pod counts silent fallbacks (a decode recomputing prompts, unclaimed state): pod.fallbacks.
SILENT_FALLBACK_CONDITION = "pdfleet.io/silent-fallback"
# The drained condition's message starts with the drain it reports (the DRAIN_ANNOTATION value), so a
# report left from an earlier drain (a cancel racing it, or a forged one) never ends a later drain.
_DRAIN_STAMP = "drain="


def drained_message(drain: str, text: str) -> str:
    """The ``pdfleet.io/drained`` message for drain ``drain`` (the annotation's value, verbatim)."""
    return f"{_DRAIN_STAMP}{drain}; {text}"


def drain_of(message: str | None) -> str | None:
    """The drain a ``pdfleet.io/drained`` message reports; None when it carries no stamp."""
    if not message or not message.startswith(_DRAIN_STAMP):
        return None
    return message[len(_DRAIN_STAMP):].split(";", 1)[0]

DnsName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)]


class ConfigError(ValueError):
    """The runtime config cannot be read; the message names the file and the field."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class StagingConfig(_Model):
    """The staged GPU path (protocol/staged.py, docs/gpu.md): one staging region per GPU rank, registered
    with its engine at start. A prefill rank's holds one ring of ``slots`` x ``slotMib``; a decode rank's
    ``lanes`` rings (one staged source each at a time: a TP 2 -> 1 request takes two), each with a block
    table area of ``tableMib``. Requests of at least ``thresholdBytes`` into a decode rank take it;
    smaller ones, and every request on host pools, take the direct write."""

    enabled: bool = Field(True, description="Allocate staging regions and stage large requests.")
    slot_mib: int = Field(256, ge=1, le=8192, description="MiB per ring slot (the largest chunk).")
    slots: int = Field(4, ge=1, le=64, description="Slots per ring: chunks in flight per staged source.")
    lanes: int = Field(2, ge=1, le=64, description="Decode: staged sources at a time (rings).")
    table_mib: int = Field(2, ge=1, le=256, description="Per lane: the block table (16 bytes per block).")
    min_chunks: int = Field(4, ge=1, le=64, description="A small request still splits into about this many chunks.")
    threshold_bytes: int = Field(32 << 20, ge=0, description="Requests below this many bytes take the direct write.")
    on_cpu: bool = Field(False, description="Stage on host pools too (tests; CPU pools keep the direct write).")


class HubSourceConfig(_Model):
    """The model's Hugging Face Hub commit, fetched once per node into a weights cache the node's pods share
    (model/hub_cache.py) before the ranks load it from ``ModelSourceConfig.path``."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$", max_length=256,
                    description="ORG/NAME (or NAME) on the Hub (spec.model.source.huggingFace.id).")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="The commit every pod loads (huggingFace.revision, "
                        "or the commit the operator resolved a branch or tag to).")
    endpoint: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=500,
                          description="The Hub, or a mirror speaking its API.")
    token_path: Path | None = Field(None, description="File holding the Hub token (a mounted Secret); unset: "
                                    "anonymous.")
    cache: Path = Field(description="The node's weights cache (a hostPath the pods of a node share).")
    timeout_seconds: float = Field(60.0, gt=0, le=3600, description="Deadline of each request to the Hub.")


class ModelSourceConfig(_Model):
    """The built-in runtime as a reference engine (docs/reference-engine.md): its rank processes compute this
    model and move its real state. Unset, they fill seeded state (byte parity, canaries, benchmarks)."""

    path: Path = Field(description="The model directory in the pod (Hugging Face layout: config.json, "
                       "safetensors, optional tokenizer files); spec.model.source.path. Read with "
                       "trust_remote_code off; nothing is fetched.")
    init_seed: int = Field(0, ge=0, lt=2**63, description="Without weights in the directory: the seed the "
                           "weights are drawn from.")
    init_range: float | None = Field(None, gt=0, le=10, description="Without weights: their init range (the "
                                     "config's initializer_range when unset).")
    max_weight_gib: int = Field(64, ge=1, le=4096, description="The most safetensors the directory may hold.")
    digest: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$", description="The content the directory "
                               "must hold (spec.model.source.digest; model/digest.py); checked before loading.")
    hub: HubSourceConfig | None = Field(None, description="Fetch ``path`` from the Hub first, through the "
                                        "node's weights cache; ``path`` must be the commit's place in that cache.")

    @model_validator(mode="after")
    def _path_in_cache(self) -> ModelSourceConfig:
        if self.hub is not None and self.path != (want := snapshot_dir(self.hub.cache, self.hub.id, self.hub.commit)):
            raise ValueError(f"model.path {self.path} is not where the weights cache keeps {self.hub.id}@"
                             f"{self.hub.commit} ({want}): set path to it")
        return self


class GroupConfig(_Model):
    """One replica across ``nodes`` pods (``nodesPerReplica``): member m holds the replica's ranks
    ``[m * world / nodes, (m + 1) * world / nodes)``. Member 0, the leader, serves HTTP and (prefill) the
    bootstrap for the whole replica; the others run only their ranks. Which member a pod is comes from
    its environment (``GROUP_MEMBER_ENV``, ``GROUP_LEADER_ENV``), since every member reads this file.
    Group messages are signed with a key of this role only (``secretPath``, a Secret mounted into the
    role's pods only), so the other role's pods, which hold the deployment key, cannot speak for a rank."""

    nodes: int = Field(ge=2, le=64, description="Pods (nodes) per replica.")
    service: DnsName = Field(description="Headless Service of the role's groups (publishNotReadyAddresses).")
    port: int = Field(GROUP_PORT, ge=1, le=65535, description="Where group members talk to each other.")
    secret_path: Path = Field(description="File holding the role's group key.")


class ComputeCost(_Model):
    """A declared compute cost for the seeded mode (``compute_cost``): load makes queues, TTFT, ITL and KV
    use move as an engine's would, on a machine without the engine. Zero everywhere: no cost (the default)."""

    prefill_seconds_per_prompt_token: float = Field(0.0, ge=0, le=1, description="Prefill: seconds of compute "
                                                    "per prompt token; a pod computes one prompt at a time, FIFO.")
    decode_seconds_per_token: float = Field(0.0, ge=0, le=10, description="Decode: seconds of one step (one "
                                            "generated token of every running request), the batch's fixed part.")
    decode_seconds_per_running_request: float = Field(0.0, ge=0, le=10, description="Decode: seconds a step "
                                                      "grows by per running request (the batch's part).")
    startup_seconds: float = Field(0.0, ge=0, le=3600, description="Seconds after start before the pod may "
                                   "report Ready (an engine loading weights and warming up).")


class RuntimeConfig(_Model):
    """Everything one pod's runtime needs to start; written by the operator per role."""

    schema_version: int = Field(CONFIG_SCHEMA_VERSION, description="Version of this file's schema.")
    deployment: DnsName = Field(description="Name of the owning PDDeployment.")
    namespace: DnsName = Field(description="Namespace of the deployment.")
    role: Role = Field(description="This pod's role.")
    runtime_version: str = Field(description="The runtime version the operator expects in the image.")
    layout: LayoutRef = Field(description="The model's state layout.")
    model_identity: str | None = Field(None, min_length=1, max_length=200, description="The model every peer "
                                       "must serve: `hf:ORG/NAME@COMMIT` (huggingFace.revision) or `dir:sha256:...` "
                                       "(source.digest); unset when not pinned. A prefill and a decode of different "
                                       "identities refuse each other at the handshake (wire 1.2).")
    shape: ParallelShape = Field(description="This role's parallel shape ``{tensor, pipeline}``: a pod holds "
                                 "tensor x pipeline ranks, one GPU each.")
    peer_shape: ParallelShape = Field(description="The other role's parallel shape (planning needs both).")
    backend: Backend = Field(description="Transfer engine.")
    protocol: LinkProtocol = Field(description="Link asked for; the engine settings follow from it.")
    rdma_devices: tuple[str, ...] = Field((), description="RDMA device names for protocol rdma.")
    max_concurrent_requests: int = Field(ge=1, description="Slots and rows per rank.")
    kv_tokens: int = Field(ge=1, description="KV tokens per replica.")
    prefill_service: DnsName = Field(
        description="Headless Service of the prefill pods: decode resolves each prefill pod through it "
        "(never a load-balanced Service: each prefill pod's registry is its own)."
    )
    secret_path: Path = Field(description="File holding the per-deployment secret that signs messages.")
    worker_key_path: Path | None = Field(
        None, description="File holding the deployment's worker key: the routes of the HTTP port that start or hold "
        "work want it as 'Authorization: Bearer <key>' (the routers send it). Unset: no key asked (local runs).")
    http_port: int = Field(HTTP_PORT, ge=1, le=65535)
    metrics_port: int = Field(METRICS_PORT, ge=1, le=65535, description="GET /metrics alone (Prometheus).")
    admin_port: int = Field(ADMIN_PORT, ge=1, le=65535,
                            description="Drain and cancel; listens on the pod's loopback only (docs/security.md).")
    bootstrap_port: int = Field(BOOTSTRAP_PORT, ge=1, le=65535)
    engine_port: int = Field(ENGINE_PORT, ge=1, le=65535)
    readiness_gate: str = Field(READINESS_GATE, description="Pod condition type the runtime sets.")
    canary_period_seconds: float | None = Field(
        None, gt=0, le=3600, description="A ready pod's canary period (spec.transfer.canaryPeriodSeconds); unset: the "
        "runtime's default. A --canary-period flag wins.")
    drain_timeout_seconds: int = Field(600, ge=0, description="Budget for finishing in-flight transfers.")
    router_drop_seconds: float = Field(
        0.0, ge=0, le=60,
        description="A drain answers /health 503 and keeps admitting this long before it refuses new work: the "
        "bound for every router's health check to drop the pod (the operator sets it with spec.router; 0 without).",
    )
    router_health_failures: int = Field(
        0, ge=0, le=100,
        description="The routers' --health-failure-threshold: once every router checking /health has been answered "
        "503 this many times during a drain, it has dropped the pod and the window ends early (then a 1 s grace); "
        "0: the window always lasts routerDropSeconds.",
    )
    device: str = Field("cuda", pattern=r"^(cpu|cuda)$", description="Where the pools live.")
    placement: tuple[Annotated[int, Field(ge=0, le=255)], ...] | None = Field(
        None, description="GPU index of each local rank (rank i on cuda:placement[i]); several ranks may share a "
        "device. Unset: rank i on cuda:i.")
    staging: StagingConfig = Field(default_factory=StagingConfig, description="The staged GPU path.")
    group: GroupConfig | None = Field(
        None, description="Set when a replica spans several pods (nodesPerReplica > 1); unset: one pod per replica.")
    model: ModelSourceConfig | None = Field(
        None, description="Compute this model (the reference engine); unset: seeded state. The layout must agree "
        "with its config.json (the ranks refuse to start otherwise, naming the field).")
    compute_cost: ComputeCost | None = Field(
        None, description="Seeded mode: a declared compute cost (prefill per prompt token, decode per step and per "
        "running request, a start-up delay before Ready); unset: none, unless the pod's PDFLEET_COMPUTE_COST "
        "environment variable gives one (JSON, the same fields).")
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256, pattern=SERVED_NAME_PATTERN,
        description="The model name the worker API answers as (OpenAI ``model``, /v1/models); the deployment's "
        "name when unset.",
    )

    @model_validator(mode="after")
    def _ports_distinct(self) -> RuntimeConfig:
        last_engine = self.engine_port + self.shape.world - 1
        for name, port in (("httpPort", self.http_port), ("metricsPort", self.metrics_port),
                           ("adminPort", self.admin_port), ("bootstrapPort", self.bootstrap_port)):
            if self.engine_port <= port <= last_engine:
                raise ValueError(f"{name} {port} overlaps the engine ports {self.engine_port}-{last_engine}")
        ports = [self.http_port, self.metrics_port, self.admin_port, self.bootstrap_port] + (
            [self.group.port] if self.group else [])
        if len(set(ports)) < len(ports):
            raise ValueError("httpPort, metricsPort, adminPort, bootstrapPort and group.port must differ")
        if self.group is not None:
            if self.engine_port <= self.group.port <= last_engine:
                raise ValueError(f"group.port {self.group.port} overlaps the engine ports {self.engine_port}-{last_engine}")
            if self.shape.world % self.group.nodes:
                raise ValueError(f"group.nodes {self.group.nodes} does not divide the replica's {self.shape.world} ranks "
                                 "(tensor x pipeline): every member holds the same number of ranks")
        if self.placement is not None and len(self.placement) != self.local_world:
            raise ValueError(f"placement lists {len(self.placement)} GPUs for {self.local_world} local ranks: give one "
                             "GPU index per rank (tensor x pipeline), or leave it unset for rank i on cuda:i")
        return self

    @property
    def local_world(self) -> int:
        """Ranks one pod holds: the replica's world, or its share of it in a group."""
        return self.shape.world // (self.group.nodes if self.group else 1)

    def device_of(self, rank: int) -> str:
        """The device local rank ``rank`` places its pools and staging region on."""
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{self.placement[rank] if self.placement is not None else rank}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True)


def load_config(path: Path) -> RuntimeConfig:
    """Read and check a config file; every problem becomes one ConfigError naming the fields."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read runtime config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"runtime config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"runtime config {path} must be a mapping, got {type(data).__name__}")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"runtime config {path} is invalid: {problems}") from exc
