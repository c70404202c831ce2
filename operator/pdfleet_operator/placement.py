"""Pure placement check: can each role's pod fit on some node at all?

Pods that can never be scheduled sit Pending with only a scheduler event to explain them. The
operator checks the nodes it can see each reconcile and reports ``Degraded`` with the reason:
no node matches the role's nodeSelector and tolerations; no matching node has enough GPUs for
one replica (tensor x pipeline); too few such nodes for a multi-node replica's group, or none sharing a
value of ``spec.scheduling.topologyKey`` with enough of them; or the role's pools per rank exceed the GPU
memory that the matching nodes advertise (the ``nvidia.com/gpu.memory`` label of GPU feature discovery, MiB).

This checks capacity, not current free room: a full cluster is not Degraded, just busy (the
pods are still created so a cluster autoscaler can react).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, RoleSpec
from pdfleet_operator.resources.pods import GPU_RESOURCE, role_spec
from pdfleet_runtime.layouts import LayoutError, rank_state_bytes, resolve_layout

__all__ = ["GPU_MEMORY_LABEL", "NodeFacts", "PlacementProblem", "Problem", "check_placement", "node_facts"]

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
MIB = 1 << 20


class Problem(StrEnum):
    NO_MATCHING_NODES = "NoMatchingNodes"
    INSUFFICIENT_GPUS_PER_NODE = "InsufficientGPUsPerNode"
    POOL_EXCEEDS_GPU_MEMORY = "PoolExceedsGPUMemory"
    TOO_FEW_NODES_FOR_GROUP = "TooFewNodesForGroup"
    TOPOLOGY_DOMAIN_TOO_SMALL = "TopologyDomainTooSmall"


@dataclass(frozen=True)
class NodeFacts:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    gpus: int = 0
    unschedulable: bool = False

    @property
    def gpu_memory_bytes(self) -> int | None:
        raw = self.labels.get(GPU_MEMORY_LABEL, "")
        return int(raw) * MIB if raw.isdigit() else None


@dataclass(frozen=True)
class PlacementProblem:
    role: Role
    problem: Problem
    message: str


def node_facts(node: Mapping) -> NodeFacts:
    """A Node object (as JSON) reduced to what placement needs."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    raw = str((status.get("allocatable") or {}).get(GPU_RESOURCE, "0"))
    return NodeFacts(
        name=meta.get("name", "?"),
        labels=dict(meta.get("labels") or {}),
        taints=tuple(t for t in spec.get("taints") or () if t.get("effect") in ("NoSchedule", "NoExecute")),
        gpus=int(raw) if raw.isdigit() else 0,
        unschedulable=bool(spec.get("unschedulable")),
    )


def _tolerates(tolerations: Sequence[Mapping], taint: Mapping) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _matches(rs: RoleSpec, node: NodeFacts) -> bool:
    if node.unschedulable:
        return False
    if any(node.labels.get(k) != v for k, v in (rs.node_selector or {}).items()):
        return False
    tolerations = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in rs.tolerations or ()]
    return all(_tolerates(tolerations, taint) for taint in node.taints)


def _pool_bytes(spec: PDDeploymentSpec, rs: RoleSpec) -> int | None:
    try:
        layout = resolve_layout(spec.model.layout)
        tp, pp = rs.parallelism.tensor, rs.parallelism.pipeline
        return max(
            rank_state_bytes(layout, tp, pp, stage, rs.pool.max_concurrent_requests, rs.pool.kv_tokens_per_replica)
            for stage in range(pp)
        )
    except (LayoutError, ValueError):
        return None  # admission reports layout problems; placement has nothing to add


def check_placement(spec: PDDeploymentSpec, nodes: Iterable[NodeFacts]) -> list[PlacementProblem]:
    nodes = list(nodes)
    problems: list[PlacementProblem] = []
    for role in Role:
        rs = role_spec(spec, role)
        if rs.replicas == 0:
            continue
        need, nodes_per_replica = rs.parallelism.gpus_per_pod, rs.parallelism.nodes_per_replica
        candidates = [n for n in nodes if _matches(rs, n)]
        if not candidates:
            sel = ", ".join(f"{k}={v}" for k, v in (rs.node_selector or {}).items()) or "(none)"
            problems.append(PlacementProblem(
                role, Problem.NO_MATCHING_NODES,
                f"no schedulable node matches spec.{role.value}.nodeSelector {sel} and tolerates its taints "
                f"({len(nodes)} nodes seen); fix the selector or tolerations, or add nodes"))
            continue
        most = max(n.gpus for n in candidates)
        if most < need:
            where = "on one node" if nodes_per_replica == 1 else f"per node ({nodes_per_replica} nodes per replica)"
            problems.append(PlacementProblem(
                role, Problem.INSUFFICIENT_GPUS_PER_NODE,
                f"one {role.value} replica needs {need} GPUs (tensor {rs.parallelism.tensor} x pipeline "
                f"{rs.parallelism.pipeline}) {where}, but matching nodes have at most {most}; lower "
                f"spec.{role.value}.parallelism or add larger nodes"))
            continue
        fit = sum(n.gpus >= need for n in candidates)
        if fit < nodes_per_replica:
            problems.append(PlacementProblem(
                role, Problem.TOO_FEW_NODES_FOR_GROUP,
                f"one {role.value} replica spans {nodes_per_replica} nodes (one pod per node, {need} GPUs each), "
                f"but only {fit} matching node(s) have {need} GPUs: its pods would pend; add nodes or lower "
                f"spec.{role.value}.parallelism.nodesPerReplica"))
            continue
        key = spec.scheduling.topology_key
        domains = Counter(n.labels[key] for n in candidates if key and n.gpus >= need and key in n.labels)
        if key and nodes_per_replica > 1 and max(domains.values(), default=0) < nodes_per_replica:
            seen = (f"the largest value has {max(domains.values())} such node(s)" if domains
                    else "no matching node carries that label")
            problems.append(PlacementProblem(
                role, Problem.TOPOLOGY_DOMAIN_TOO_SMALL,
                f"one {role.value} replica spans {nodes_per_replica} nodes ({need} GPUs each) that must share "
                f"spec.scheduling.topologyKey {key}, but {seen}: its pods would pend; fix the key or the nodes' "
                "labels, or remove the key"))
            continue
        pool = _pool_bytes(spec, rs)
        sizes = [m for n in candidates if n.gpus >= need and (m := n.gpu_memory_bytes) is not None]
        if pool is not None and sizes and pool > max(sizes):
            problems.append(PlacementProblem(
                role, Problem.POOL_EXCEEDS_GPU_MEMORY,
                f"{role.value} pools need {pool / (1 << 30):.1f} GiB per GPU, but matching nodes' GPUs have at "
                f"most {max(sizes) / (1 << 30):.1f} GiB ({GPU_MEMORY_LABEL}); lower "
                f"spec.{role.value}.pool or use larger GPUs"))
    return problems
