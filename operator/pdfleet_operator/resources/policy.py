"""Per-deployment NetworkPolicy and per-role PodDisruptionBudgets.

The NetworkPolicy admits traffic to the deployment's pods from the same deployment's pods only
(prompt state must not be reachable from elsewhere), plus the workers' HTTP port from the
deployment's routers (``resources.router``; they carry their own label, not the deployment's),
and from nothing else: whoever reaches that port can send prompts. It does not
list the engine ports: Mooncake and NIXL pick their data ports themselves (UCX and Mooncake's TCP
transport bind ephemeral ports), so a port list would silently block transfers; the pod selector
is what scopes them.

Where a role's replicas span nodes, the group port (``GROUP_PORT``, rank messages inside a replica)
is open between that role's pods only: the deployment-wide rule then lists every TCP port but it
(two ranges) and a policy per role (``group_network_policy``) opens it from the same role.

A PDB limits voluntary evictions (node drains) to ``max(1, maxUnavailable)`` pods per role;
it never blocks the operator's own deletions, which follow the rollout's budgets.
"""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.resources.names import group_policy_name, owner_labels, role_selector
from pdfleet_operator.resources.router import LABEL_ROUTER
from pdfleet_runtime.config import GROUP_PORT, HTTP_PORT

__all__ = ["OPERATOR_LABELS", "group_network_policy", "network_policy", "pdb_name", "pod_disruption_budget", "policy_name"]


def policy_name(deployment: str) -> str:
    return f"{deployment}-transfer"[:253]


def pdb_name(deployment: str, role: Role) -> str:
    return f"{deployment}-{role.value}"[:253]


OPERATOR_LABELS = {"app.kubernetes.io/part-of": "pdfleet", "app.kubernetes.io/component": "operator"}
"""The operator's pods (the chart's labels), in whichever namespace the chart put them."""


def network_policy(name: str, namespace: str, worker_port: int = HTTP_PORT, groups: bool = False,
                   scrape_port: int | None = None) -> dict:
    """``groups``: some role's replicas span nodes, so the group port is left out of the deployment-wide rule.
    ``scrape_port``: where the operator's autoscaler reads the pods' ``/metrics``, admitted from its pods only."""
    same_deployment: dict = {"from": [{"podSelector": {"matchLabels": owner_labels(name)}}]}
    if groups:
        same_deployment["ports"] = [{"protocol": "TCP", "port": 1, "endPort": GROUP_PORT - 1},
                                    {"protocol": "TCP", "port": GROUP_PORT + 1, "endPort": 65535},
                                    {"protocol": "UDP"}]
    routers = {"podSelector": {"matchLabels": {LABEL_ROUTER: name}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "spec": {
            "podSelector": {"matchLabels": owner_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                same_deployment,  # bootstrap, handshake and the engines' own data ports
                {"from": [routers], "ports": [{"protocol": "TCP", "port": worker_port}]},
                *([{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}],
                    "ports": [{"protocol": "TCP", "port": scrape_port}]}] if scrape_port is not None else []),
            ],
        },
    }


def group_network_policy(name: str, namespace: str, role: Role) -> dict:
    """The group port between the pods of one role: a pod of the other role cannot reach a rank's port."""
    same_role = {"podSelector": {"matchLabels": role_selector(name, role)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": group_policy_name(name, role), "namespace": namespace, "labels": owner_labels(name)},
        "spec": {
            "podSelector": {"matchLabels": role_selector(name, role)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [same_role], "ports": [{"protocol": "TCP", "port": GROUP_PORT}]}],
        },
    }


def pod_disruption_budget(name: str, namespace: str, role: Role, max_unavailable: int) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": pdb_name(name, role), "namespace": namespace, "labels": owner_labels(name)},
        "spec": {
            "maxUnavailable": max(1, max_unavailable),
            "selector": {"matchLabels": role_selector(name, role)},
        },
    }
