"""`vllm serve` per role, rendered from the same spec fields as SGLang's command (docs/vllm.md).

Pure functions of (deployment name, spec, role, replica-group member); ``resources/engine.py`` builds the
pod around them as for SGLang (the engine container beside the agent, the GPUs, the model volume).

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
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.engine import role_engine
from pdfleet_runtime.engine_rules.vllm import ENGINE_PORT, MASTER_PORT, vllm_parallel
from pdfleet_runtime.engine_rules.vllm_render import FIELD_REF_ENV, kv_transfer_config, transfer_env

__all__ = ["ANNOTATION_VLLM_BOOTSTRAP_PORT", "vllm_command", "vllm_env"]

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


def _group(spec: PDDeploymentSpec, role: Role, member: tuple[int, str] | None) -> list[str]:
    """vLLM's multi-node start for a replica group: ``member`` is (node rank, the first pod's host)."""
    nodes = (spec.prefill if role is Role.PREFILL else spec.decode).parallelism.nodes_per_replica
    if nodes == 1:
        return []
    if member is None:
        raise ValueError("a replica spanning nodes needs its group member (node rank and first pod)")
    rank, leader = member
    out = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", leader,
           "--master-port", str(MASTER_PORT)]
    return out + (["--headless"] if rank > 0 else [])


def vllm_command(name: str, spec: PDDeploymentSpec, role: Role, member: tuple[int, str] | None = None) -> list[str]:
    t = spec.transfer
    return [
        "vllm", "serve", _model(spec),
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
