"""Names and labels of every child object, derived from the PDDeployment's name.

Deterministic names are what make reconcile idempotent: a second create of the same child
answers AlreadyExists instead of making a duplicate, even across an operator restart.
"""

from __future__ import annotations

import hashlib

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, LABEL_REVISION, LABEL_ROLE, Role
from pdfleet_runtime.config import DRAIN_ANNOTATION, DRAINED_CONDITION

__all__ = [
    "ANNOTATION_DECODE_COMPAT",
    "ANNOTATION_DRAIN",
    "ANNOTATION_DRAIN_CANCELLED",
    "ANNOTATION_PREFILL_COMPAT",
    "CONDITION_DRAINED",
    "HUB_TOKEN_FILE",
    "HUB_TOKEN_MOUNT",
    "LABEL_COMPAT",
    "LABEL_GROUP",
    "LABEL_INDEX",
    "LABEL_MEMBER",
    "LABEL_ROUTABLE",
    "MANAGED_BY",
    "SECRET_FILE",
    "WEIGHTS_MOUNT",
    "WEIGHTS_VOLUME",
    "WORKER_SECRET_MOUNT",
    "config_name",
    "group_pod_name",
    "group_policy_name",
    "group_secret_name",
    "group_service_name",
    "owner_labels",
    "pod_labels",
    "pod_name",
    "role_selector",
    "router_name",
    "router_secret_name",
    "secret_name",
    "service_account_name",
    "service_name",
    "worker_secret_name",
]

LABEL_INDEX = f"{GROUP}/index"
# A pod's place in its replica group: "0" is the leader (every single-node pod is its own group's leader);
# the router and the role's Service select leaders only where a role's replicas span nodes.
LABEL_MEMBER = f"{GROUP}/group-member"
# The leader's pod name, on every pod of a multi-node group: the members' anti-affinity selects it.
LABEL_GROUP = f"{GROUP}/group"
# Routers send new requests only to pods labelled routable=true; a drain sets it false first.
LABEL_ROUTABLE = f"{GROUP}/routable"
# The pod's compatibility key (resources.compat.compat_key): decode pairs only with equal keys.
LABEL_COMPAT = f"{GROUP}/compat"
# The router Deployment's: the compatibility keys its selectors carry (the generation it pairs: generations.py).
ANNOTATION_PREFILL_COMPAT = f"{GROUP}/prefill-compat"
ANNOTATION_DECODE_COMPAT = f"{GROUP}/decode-compat"
# Epoch seconds when the operator started draining the pod; the runtime stops admitting on it.
ANNOTATION_DRAIN = DRAIN_ANNOTATION
# Epoch seconds when the operator cancelled the pod's drain (routable again); see plan.DRAIN_CANCEL_SETTLE_S.
ANNOTATION_DRAIN_CANCELLED = f"{GROUP}/drain-cancelled"
# Pod condition the runtime sets True once a drained pod has no transfer in flight.
CONDITION_DRAINED = DRAINED_CONDITION
MANAGED_BY = "pdfleet-operator"
MAX_LABEL = 63


def _fit(name: str, limit: int = MAX_LABEL) -> str:
    """Shorten a DNS label past ``limit`` with a stable hash suffix (hostnames must be <= 63)."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def service_name(deployment: str, role: Role) -> str:
    """Headless Service of a role; pods get DNS ``<hostname>.<service>.<ns>.svc``."""
    return _fit(f"{deployment}-{role.value}")


def config_name(deployment: str, role: Role, revision: str) -> str:
    """One runtime ConfigMap per revision: a rollback's pods must get their own revision's config."""
    return _fit(f"{deployment}-{role.value}-{revision[:10]}-runtime", 253)


def secret_name(deployment: str) -> str:
    return _fit(f"{deployment}-transfer-auth", 253)


SECRET_FILE = "key"
"""The item of every key Secret (transfer, group, worker key) and its file in the mount."""
WORKER_SECRET_MOUNT = "/var/run/pdfleet/worker-auth"
"""Where runtime and router pods mount the worker key (routers to the worker API)."""
WEIGHTS_VOLUME = "weights-cache"
"""The node's weights cache (``huggingFace.cache``) in a pod's volumes."""
WEIGHTS_MOUNT = "/var/lib/pdfleet/weights"
"""Where a built-in runtime pod mounts the node's weights cache (read-write: the first pod fills it)."""
HUB_TOKEN_MOUNT = "/var/run/pdfleet/hub-token"
"""Where a built-in runtime pod mounts ``huggingFace.tokenSecret`` (a file: no token in its environment)."""
HUB_TOKEN_FILE = "token"


def worker_secret_name(deployment: str) -> str:
    """The worker key (item ``key``): the routers send it to the workers, whose worker API wants it."""
    return _fit(f"{deployment}-worker-auth", 253)


def router_name(deployment: str) -> str:
    """The router's Deployment, Service (the endpoint), ServiceAccount, Role and NetworkPolicy."""
    return _fit(f"{deployment}-router")


def router_secret_name(deployment: str) -> str:
    """The router's control-plane API keys (``/workers``, ``/flush_cache``: admin only)."""
    return _fit(f"{deployment}-router-keys", 253)


def service_account_name(deployment: str) -> str:
    return _fit(f"{deployment}-runtime", 253)


def pod_name(deployment: str, role: Role, revision: str, index: int) -> str:
    """``<deployment>-<role>-<revision[:6]>-<index>``, at most 63 characters (it is the hostname)."""
    return _fit(f"{deployment}-{role.value}-{revision[:6]}-{index}")


def group_service_name(deployment: str, role: Role) -> str:
    """Headless Service of a role's multi-node replica groups (``publishNotReadyAddresses``: a group's
    ``--dist-init-addr`` must resolve before any member is Ready). Pods of a group get DNS
    ``<pod>.<service>.<ns>.svc`` through ``hostname`` and ``subdomain``."""
    return _fit(f"{deployment}-{role.value}-group")


def group_pod_name(deployment: str, role: Role, revision: str, index: int, member: int) -> str:
    """Member ``member`` of replica ``index``'s group: member 0 is ``pod_name`` itself (it serves HTTP,
    carries the bootstrap-port annotation and is the router's worker); the others add ``-m<member>``."""
    base = pod_name(deployment, role, revision, index)
    return base if member == 0 else _fit(f"{deployment}-{role.value}-{revision[:6]}-{index}-m{member}")


def group_secret_name(deployment: str, role: Role) -> str:
    """The role's group key (item ``key``): signs rank messages between the pods of its groups only."""
    return _fit(f"{deployment}-{role.value}-group-auth", 253)


def group_policy_name(deployment: str, role: Role) -> str:
    """The NetworkPolicy opening the group port between the role's pods."""
    return _fit(f"{deployment}-{role.value}-group", 253)


def owner_labels(deployment: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, "app.kubernetes.io/managed-by": MANAGED_BY}


def role_selector(deployment: str, role: Role) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role.value}


def pod_labels(deployment: str, role: Role, revision: str, index: int, member: int = 0) -> dict[str, str]:
    return {
        **owner_labels(deployment),
        LABEL_ROLE: role.value,
        LABEL_REVISION: revision,
        LABEL_INDEX: str(index),
        LABEL_MEMBER: str(member),
        LABEL_ROUTABLE: "true",
        "app.kubernetes.io/name": "pdfleet-runtime",
        "app.kubernetes.io/component": role.value,
    }
