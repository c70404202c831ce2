"""Headless Services: stable per-pod DNS for peer discovery, never load balancing.

``publishNotReadyAddresses`` is on because discovery must precede readiness: a pod becomes
Ready only after a handshake and canary transfer with its peer, which needs the peer's DNS.
Routing of user traffic is not this Service's job.
"""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.resources.names import LABEL_MEMBER, owner_labels, role_selector, service_name
from pdfleet_runtime.config import BOOTSTRAP_PORT, ENGINE_PORT, HTTP_PORT, METRICS_PORT

__all__ = ["headless_service"]


def headless_service(name: str, namespace: str, role: Role, engine_ports: int, leaders_only: bool = False) -> dict:
    """``leaders_only`` (a role whose replicas span nodes): the Service holds each group's leader only, the
    pod that serves the worker API and the bootstrap, so peers discovering the role see one pod per
    replica; the members are reached through the group Service."""
    selector = role_selector(name, role) | ({LABEL_MEMBER: "0"} if leaders_only else {})
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"},
             {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"}]
    if role is Role.PREFILL:
        ports.append({"name": "bootstrap", "port": BOOTSTRAP_PORT, "targetPort": BOOTSTRAP_PORT, "protocol": "TCP"})
    ports += [
        {"name": f"engine-{r}", "port": ENGINE_PORT + r, "targetPort": ENGINE_PORT + r, "protocol": "TCP"}
        for r in range(engine_ports)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name, role), "namespace": namespace, "labels": owner_labels(name)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": ports,
        },
    }
