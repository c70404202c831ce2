"""sglang-router as a router kind: ``launch_router`` in PD mode behind pdfleet's front.

The router (``sglang-router==0.3.2``) runs on the pod's loopback, started by ``pdfleet-runtime router-launch``
with its keys read from the mounted Secrets (never in the command); the front (``pdfleet-runtime
router-front``) takes the router port: limits, the served model only, the worker key added. Its control
endpoints (``/workers`` registers a worker that would then receive prompts) are locked with an admin API
key from a per-deployment Secret created once (``admin_secret``). Discovery and health checks as
``RouterDiscovery`` says (docs/router.md).
"""

from __future__ import annotations

import base64
import secrets

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, RouterKind
from pdfleet_operator.resources.names import (
    SECRET_FILE,
    WORKER_SECRET_MOUNT,
    owner_labels,
    router_secret_name,
    worker_secret_name,
)
from pdfleet_operator.resources.plugins.contract import RouterDiscovery
from pdfleet_operator.resources.plugins.front import (
    fronted_router_containers,
    upstream_port,
    worker_key_mount,
)
from pdfleet_runtime.front.routers import FrontedRouter

__all__ = ["CONTROL_PLANE_KEY", "SGLANG_ROUTER", "SGLangRouter", "router_secret"]

CONTROL_PLANE_KEY = "control-plane-api-keys"  # the Secret's key: 'id:name:role:secret' for --control-plane-api-keys
ROUTER_KEYS_MOUNT = "/var/run/pdfleet/router-keys"
KEY_ID, KEY_NAME = "pdfleet", "pdfleet-operator"


def _command(spec: PDDeploymentSpec, d: RouterDiscovery) -> list[str]:
    router = spec.router
    assert router is not None
    return [
        "pdfleet-runtime", "router-launch",
        "--api-key-file", f"{WORKER_SECRET_MOUNT}/{SECRET_FILE}",
        "--control-plane-keys-file", f"{ROUTER_KEYS_MOUNT}/{CONTROL_PLANE_KEY}",
        "--",
        "--pd-disaggregation",
        "--host", "127.0.0.1", "--port", str(upstream_port(router)),
        "--prometheus-host", "0.0.0.0", "--prometheus-port", str(router.metrics_port),
        "--prefill-policy", router.prefill_policy.value,
        "--decode-policy", router.decode_policy.value,
        "--service-discovery",
        "--service-discovery-namespace", d.namespace,
        "--service-discovery-port", str(d.worker_port),
        "--prefill-selector", *d.prefill_selector,
        "--decode-selector", *d.decode_selector,
        "--health-check-interval-secs", str(d.health_interval_s),
        "--health-failure-threshold", str(d.health_failures),
        "--health-check-timeout-secs", str(d.health_timeout_s),
        "--worker-startup-check-interval", str(d.startup_check_s),
    ]


def router_secret(deployment: str, namespace: str, key: str | None = None) -> dict:
    """Created once with a random admin key; never rewritten (clients holding it would be cut off)."""
    key = key if key is not None else secrets.token_urlsafe(32)
    value = f"{KEY_ID}:{KEY_NAME}:admin:{key}"
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": router_secret_name(deployment), "namespace": namespace,
                     "labels": owner_labels(deployment)},
        "data": {CONTROL_PLANE_KEY: base64.b64encode(value.encode()).decode()},
    }


class SGLangRouter:
    """``spec.router.kind: sglang``."""

    kind = RouterKind.SGLANG

    def command(self, deployment: str, namespace: str, spec: PDDeploymentSpec,
                discovery: RouterDiscovery) -> list[str]:
        return _command(spec, discovery)

    def containers(self, deployment: str, namespace: str, spec: PDDeploymentSpec, discovery: RouterDiscovery,
                   security: dict) -> list[dict]:
        return fronted_router_containers(deployment, spec, FrontedRouter.SGLANG, _command(spec, discovery), security,
                                         [worker_key_mount(), {"name": "router-keys", "mountPath": ROUTER_KEYS_MOUNT, "readOnly": True}])

    def volumes(self, deployment: str) -> list[dict]:
        return [
            {"name": "worker-auth", "secret": {"secretName": worker_secret_name(deployment), "defaultMode": 0o440}},
            {"name": "router-keys", "secret": {"secretName": router_secret_name(deployment), "defaultMode": 0o440}},
        ]

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        return router_secret(deployment, namespace, key)

    def worker_annotations(self, role: Role) -> dict[str, str]:
        return {}  # its bootstrap port default (8998) is the built-in runtime's

    def worker_args(self, role: Role) -> list[str]:
        return []


SGLANG_ROUTER = SGLangRouter()
