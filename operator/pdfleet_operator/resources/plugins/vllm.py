"""vLLM as an engine kind: `vllm serve` per role in the ``engine`` container beside the agent (docs/vllm.md).

Pure functions of (deployment name, spec, role, replica-group member); the generic engine pod
(``resources.engine.with_engine``) is built around them (the engine container beside the agent, the GPUs,
the model volume).

- the model path as vLLM's positional argument, ``--served-model-name``;
- parallelism through ``vllm_parallel``: ``--tensor-parallel-size tensor/data``, ``--data-parallel-size
  data`` (vLLM's DP multiplies GPUs; pdfleet's ``data`` is attention DP inside ``tensor``), ``--enable-
  expert-parallel`` when ``expert`` = tensor, ``--pipeline-parallel-size``; a replica spanning nodes as
  vLLM's multiprocessing multi-node start (``--nnodes``, ``--node-rank``, ``--master-addr`` of the group's
  first pod, ``--master-port``, ``--headless`` on the other members);
- ``--kv-transfer-config`` from ``spec.transfer`` and the role (``engine_rules.vllm_render``);
- ``--host 0.0.0.0 --port 30000``; then ``spec.engine.args`` and the role's.
"""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec
from pdfleet_operator.engine import revision_flags, role_engine
from pdfleet_operator.resources.plugins.contract import GroupMember, NamedPort, WorkerContract
from pdfleet_runtime.engine_rules import EngineRules
from pdfleet_runtime.engine_rules.vllm import ENGINE_PORT, MASTER_PORT, PROTOCOLS, vllm_parallel
from pdfleet_runtime.engine_rules.vllm_plugin import VLLM as VLLM_RULES
from pdfleet_runtime.engine_rules.vllm_render import (
    FIELD_REF_ENV,
    bootstrap_port,
    kv_transfer_config,
    transfer_env,
)
from pdfleet_runtime.links import LinkProtocol

__all__ = ["ANNOTATION_VLLM_BOOTSTRAP_PORT", "VLLM", "VllmContainer", "VllmEngine", "vllm_command", "vllm_env"]

ANNOTATION_VLLM_BOOTSTRAP_PORT = "vllm.ai/bootstrap-port"  # vllm-router's Kubernetes discovery reads it


def _model(spec: PDDeploymentSpec) -> str:
    src = spec.model.source
    if src is None:  # admission denies it (engine-model-source)
        raise ValueError("spec.model.source is required for a vLLM engine")
    return src.path if src.path is not None else src.hugging_face.id  # type: ignore[union-attr]


def _parallel(spec: PDDeploymentSpec, role: Role) -> list[str]:
    p = (spec.prefill if role is Role.PREFILL else spec.decode).parallelism
    mapped = vllm_parallel(p.tensor, p.data, p.expert)
    if mapped is None:  # admission denies it (vllm.expert-mapping, attn-dp-divides-tp)
        raise ValueError(f"parallelism {p.tensor}/{p.data}/{p.expert} has no vLLM form")
    tp, dp, ep = mapped
    out = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(p.pipeline)]
    if dp > 1:
        out += ["--data-parallel-size", str(dp)]
    if ep:
        out.append("--enable-expert-parallel")
    return out


def _group(spec: PDDeploymentSpec, role: Role, member: GroupMember | None) -> list[str]:
    """vLLM's multi-node start for a replica group: ``member`` is (node rank, the first pod's host)."""
    nodes = (spec.prefill if role is Role.PREFILL else spec.decode).parallelism.nodes_per_replica
    if nodes == 1:
        return []
    if member is None:
        raise ValueError("a replica spanning nodes needs its group member (node rank and first pod)")
    rank, leader = member.node_rank, member.leader_host
    out = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", leader,
           "--master-port", str(MASTER_PORT)]
    return out + (["--headless"] if rank > 0 else [])


def vllm_command(name: str, spec: PDDeploymentSpec, role: Role, member: GroupMember | None = None) -> list[str]:
    t = spec.transfer
    return [
        "vllm", "serve", _model(spec),
        *revision_flags(spec),
        "--served-model-name", spec.model.served_name or name,
        *_parallel(spec, role),
        *_group(spec, role, member),
        "--kv-transfer-config", kv_transfer_config(t.backend, t.protocol, role.value, t.rdma_devices),
        "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
        *role_engine(spec, role).args,
    ]


def vllm_env(spec: PDDeploymentSpec) -> list[dict]:
    """The transfer's environment: the pod-IP variables (``valueFrom.fieldRef status.podIP`` on each variable
    itself, so NIXL advertises the pod's address to the decode), then the fixed ports and UCX settings."""
    t = spec.transfer
    env = [{"name": n, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}}
           for n in FIELD_REF_ENV[t.backend]]
    return env + [{"name": n, "value": v} for n, v in transfer_env(t.backend, t.protocol, t.rdma_devices)]


class VllmContainer:
    """The ``engine`` container's vLLM parts."""

    bootstrap_annotation = ANNOTATION_VLLM_BOOTSTRAP_PORT

    def command(self, name: str, spec: PDDeploymentSpec, role: Role, member: GroupMember | None) -> list[str]:
        return vllm_command(name, spec, role, member)

    def transfer_env(self, spec: PDDeploymentSpec, role: Role) -> list[dict]:
        return vllm_env(spec)

    def bootstrap_port(self, spec: PDDeploymentSpec) -> int:
        """NIXL's side channel (the decode's handshake) or Mooncake's bootstrap (the router's)."""
        return bootstrap_port(spec.transfer.backend)

    def host_ipc(self, spec: PDDeploymentSpec) -> bool:
        settings = PROTOCOLS[(spec.transfer.backend, spec.transfer.protocol)]
        return settings.host_ipc or spec.transfer.protocol is LinkProtocol.NVLINK


class VllmEngine:
    """``spec.engine.kind: vllm``."""

    kind = EngineKind.VLLM
    rules: EngineRules = VLLM_RULES
    worker = WorkerContract(port=ENGINE_PORT, health_path="/health")  # --port: SGLang's, so one port for all
    group_port = NamedPort(name="dist-init", port=MASTER_PORT)  # --master-port on the group's first pod
    container: VllmContainer | None = VllmContainer()


VLLM = VllmEngine()
