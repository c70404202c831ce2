"""Per-deployment NetworkPolicy and per-role PodDisruptionBudgets.

The NetworkPolicy opens the bootstrap and engine ports only to pods of the same deployment
(prompt state must not be reachable from elsewhere) and the HTTP port (health, metrics, drain)
to anyone, since kubelet probes and Prometheus come from outside the deployment.

A PDB limits voluntary evictions (node drains) to ``max(1, maxUnavailable)`` pods per role;
it never blocks the operator's own deletions, which follow the rollout's budgets.
"""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.resources.names import owner_labels, role_selector
from pdfleet_runtime.config import BOOTSTRAP_PORT, ENGINE_PORT, HTTP_PORT

__all__ = ["network_policy", "pdb_name", "pod_disruption_budget", "policy_name"]


def policy_name(deployment: str) -> str:
    return f"{deployment}-transfer"[:253]


def pdb_name(deployment: str, role: Role) -> str:
    return f"{deployment}-{role.value}"[:253]


def network_policy(name: str, namespace: str, max_ranks: int) -> dict:
    same_deployment = {"podSelector": {"matchLabels": owner_labels(name)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "spec": {
            "podSelector": {"matchLabels": owner_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [same_deployment],
                    "ports": [
                        {"protocol": "TCP", "port": BOOTSTRAP_PORT},
                        {"protocol": "TCP", "port": ENGINE_PORT, "endPort": ENGINE_PORT + max(1, max_ranks) - 1},
                    ],
                },
                {"ports": [{"protocol": "TCP", "port": HTTP_PORT}]},
            ],
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
