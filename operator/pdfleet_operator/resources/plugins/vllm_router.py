"""vllm-router as a router kind: vllm-router 0.1.17 in vLLM's PD mode, serving the router port itself.

It runs in its own image with the connector of spec.transfer.backend and Kubernetes discovery of the roles'
pods (it reads each prefill's ``vllm.ai/bootstrap-port`` annotation). The vLLM pods it sends to take no
pdfleet worker key, so no launcher and no Secret. Its worker API (``/remove_worker``, ``/workers``, ...) is
served on the router port without a key and nothing here locks it yet (docs/vllm.md, "Its worker API is
open"; a remaining item of issue 39). The probes are the routes vllm-router 0.1.17 serves on ``--port``
without a key (tests/unit/operator/test_router.py names the source lines).
"""

from __future__ import annotations

from pdfleet_operator.api.models import PDDeploymentSpec, RouterKind
from pdfleet_operator.resources.plugins.contract import ROUTER_CONTAINER, RouterDiscovery

__all__ = ["VLLM_ROUTER", "VllmRouter", "vllm_router_command"]


def vllm_router_command(spec: PDDeploymentSpec, d: RouterDiscovery) -> list[str]:
    router = spec.router
    assert router is not None
    return [
        "vllm-router",
        "--vllm-pd-disaggregation",
        "--kv-connector", str(spec.transfer.backend),
        "--host", "0.0.0.0", "--port", str(router.port),
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


class VllmRouter:
    """``spec.router.kind: vllm``."""

    kind = RouterKind.VLLM

    def command(self, deployment: str, namespace: str, spec: PDDeploymentSpec,
                discovery: RouterDiscovery) -> list[str]:
        return vllm_router_command(spec, discovery)

    def containers(self, deployment: str, namespace: str, spec: PDDeploymentSpec, discovery: RouterDiscovery,
                   security: dict) -> list[dict]:
        router = spec.router
        assert router is not None
        probe = {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5}
        return [{
            "name": ROUTER_CONTAINER,
            "image": router.image,
            "command": vllm_router_command(spec, discovery),
            "ports": [
                {"name": "http", "containerPort": router.port, "protocol": "TCP"},
                {"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"},
            ],
            "readinessProbe": probe,
            "livenessProbe": {**probe, "httpGet": {"path": "/liveness", "port": "http"}, "failureThreshold": 6},
            "resources": router.resources.model_dump(by_alias=True, exclude_none=True, mode="json"),
            "securityContext": security,
        }]

    def volumes(self, deployment: str) -> list[dict]:
        return []

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        return None


VLLM_ROUTER = VllmRouter()
