"""vllm-router as a router kind: vllm-router 0.1.17 in vLLM's PD mode behind pdfleet's front.

It runs with the connector of spec.transfer.backend and Kubernetes discovery of the roles' pods (it reads
each prefill's ``vllm.ai/bootstrap-port`` annotation), listening on the pod's loopback only (``--host
127.0.0.1``, ``front.upstream_port``). Its worker API (``/remove_worker``, ``/workers``, ...) is served on
that port without a key, so the front (``pdfleet-runtime router-front --router vllm``) takes the router
port and passes only vllm-router's serving routes; the worker API answers 404 there and stays on the pod's
loopback (docs/vllm.md, "Its worker API is behind the front"). The vLLM pods it sends to take no pdfleet
worker key, so no launcher, no key and no Secret. Probes as sglang-router's: readiness through the front to
the router's ``/readiness``, liveness on the router's metrics port, its only listener off the loopback
(tests/unit/operator/test_router.py names the source lines).
"""

from __future__ import annotations

from pdfleet_operator.api.models import PDDeploymentSpec, RouterKind
from pdfleet_operator.resources.plugins.contract import RouterDiscovery
from pdfleet_operator.resources.plugins.front import fronted_router_containers, upstream_port
from pdfleet_runtime.front.routers import FrontedRouter

__all__ = ["VLLM_ROUTER", "VllmRouter", "vllm_router_command"]


def vllm_router_command(spec: PDDeploymentSpec, d: RouterDiscovery) -> list[str]:
    router = spec.router
    assert router is not None
    return [
        "vllm-router",
        "--vllm-pd-disaggregation",
        "--kv-connector", str(spec.transfer.backend),
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


class VllmRouter:
    """``spec.router.kind: vllm``."""

    kind = RouterKind.VLLM

    def command(self, deployment: str, namespace: str, spec: PDDeploymentSpec,
                discovery: RouterDiscovery) -> list[str]:
        return vllm_router_command(spec, discovery)

    def containers(self, deployment: str, namespace: str, spec: PDDeploymentSpec, discovery: RouterDiscovery,
                   security: dict) -> list[dict]:
        return fronted_router_containers(deployment, spec, FrontedRouter.VLLM, vllm_router_command(spec, discovery), security)

    def volumes(self, deployment: str) -> list[dict]:
        return []

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        return None


VLLM_ROUTER = VllmRouter()
