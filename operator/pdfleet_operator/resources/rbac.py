"""What the runtime pods may do: patch their readiness-gate condition, nothing else.

The runtime sets ``pdfleet.io/transfer-path`` on its own pod through pods/status after a
verified canary transfer. RBAC cannot restrict by label, so the Role is namespaced and limited
to get on pods and patch on pods/status; the token is mounted only for this.
"""

from __future__ import annotations

from pdfleet_operator.resources.names import owner_labels, service_account_name

__all__ = ["runtime_role", "runtime_role_binding", "runtime_service_account"]


def runtime_service_account(name: str, namespace: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": service_account_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "automountServiceAccountToken": False,
    }


def runtime_role(name: str, namespace: str) -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": service_account_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch"]},
        ],
    }


def runtime_role_binding(name: str, namespace: str) -> dict:
    sa = service_account_name(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": sa, "namespace": namespace, "labels": owner_labels(name)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
    }
