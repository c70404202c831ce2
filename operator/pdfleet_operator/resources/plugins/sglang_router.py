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

from pdfleet_operator.api.models import PDDeploymentSpec, RouterKind, RouterSpec
from pdfleet_operator.resources.names import (
    SECRET_FILE,
    WORKER_SECRET_MOUNT,
    owner_labels,
    router_secret_name,
    worker_secret_name,
)
from pdfleet_operator.resources.plugins.contract import ROUTER_CONTAINER, RouterDiscovery

__all__ = [
    "CONTROL_PLANE_KEY",
    "FRONT_CONTAINER",
    "SGLANG_ROUTER",
    "SGLangRouter",
    "front_command",
    "router_secret",
    "upstream_port",
]

CONTROL_PLANE_KEY = "control-plane-api-keys"  # the Secret's key: 'id:name:role:secret' for --control-plane-api-keys
ROUTER_KEYS_MOUNT = "/var/run/pdfleet/router-keys"
FRONT_CONTAINER = "front"
KEY_ID, KEY_NAME = "pdfleet", "pdfleet-operator"


def upstream_port(router: RouterSpec) -> int:
    """Where sglang-router listens, on the pod's loopback only (the front takes the router port)."""
    return next(p for p in (router.port + 1, router.port + 2, router.port - 1) if p != router.metrics_port
                and 0 < p < 65536)


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


def front_command(deployment: str, spec: PDDeploymentSpec) -> list[str]:
    """The router pod's front on the router port: limits, the served model only, the worker key added."""
    router = spec.router
    assert router is not None
    return [
        "pdfleet-runtime", "router-front",
        "--listen", f"0.0.0.0:{router.port}",
        "--upstream", f"http://127.0.0.1:{upstream_port(router)}",
        "--served-model", spec.model.served_name or deployment,
        "--api-key-file", f"{WORKER_SECRET_MOUNT}/{SECRET_FILE}",
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
        router = spec.router
        assert router is not None
        worker_key = {"name": "worker-auth", "mountPath": WORKER_SECRET_MOUNT, "readOnly": True}
        container = {
            "name": ROUTER_CONTAINER,
            "image": router.image,
            "command": _command(spec, discovery),
            "ports": [{"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"}],
            "volumeMounts": [worker_key, {"name": "router-keys", "mountPath": ROUTER_KEYS_MOUNT, "readOnly": True}],
            # Its serving port is on loopback (the front's upstream); its metrics listener says it is alive.
            "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5,
                              "failureThreshold": 6},
            "resources": router.resources.model_dump(by_alias=True, exclude_none=True, mode="json"),
            "securityContext": security,
        }
        front = {
            "name": FRONT_CONTAINER,
            "image": router.image,
            "command": front_command(deployment, spec),
            "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
            "volumeMounts": [worker_key],
            # Through the front to the router: ready once both answer.
            "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
            "securityContext": security,
        }
        return [container, front]

    def volumes(self, deployment: str) -> list[dict]:
        return [
            {"name": "worker-auth", "secret": {"secretName": worker_secret_name(deployment), "defaultMode": 0o440}},
            {"name": "router-keys", "secret": {"secretName": router_secret_name(deployment), "defaultMode": 0o440}},
        ]

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        return router_secret(deployment, namespace, key)


SGLANG_ROUTER = SGLangRouter()
