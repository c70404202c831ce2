"""What the runtime pods may do: read their pod and patch its pdfleet.io conditions, nothing else.

The runtime sets ``pdfleet.io/transfer-path`` and ``pdfleet.io/drained`` on its own pod through
pods/status and reads its pod's drain annotation. RBAC cannot restrict by label, so the Role names
the deployment's own pods (``resourceNames``, re-applied each pass with the pods that exist or are
about to be created): no other app's pod can be read (its env) or written. Which of those pods a
token may write, and which conditions, is the ValidatingAdmissionPolicy's part
(``pod_status_policy``): only the pod the token is bound to, only ``pdfleet.io/*``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdfleet_operator.resources.names import owner_labels, service_account_name

__all__ = ["runtime_role", "runtime_role_binding", "runtime_service_account"]


def runtime_service_account(name: str, namespace: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": service_account_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "automountServiceAccountToken": False,
    }


def runtime_role(name: str, namespace: str, pods: Iterable[str] = ()) -> dict:
    """The Role over ``pods`` only. No pods, no rules: an empty ``resourceNames`` would mean every pod."""
    names = sorted(set(pods))
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": names},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch"], "resourceNames": names},
    ] if names else []
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": service_account_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "rules": rules,
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
