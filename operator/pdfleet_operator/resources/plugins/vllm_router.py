"""vllm-router as a router kind: vllm-router 0.1.17 in vLLM's PD mode behind pdfleet's front.

It runs with the connector of spec.transfer.backend and Kubernetes discovery of the roles' pods (it reads
each prefill's ``vllm.ai/bootstrap-port`` annotation), listening on the pod's loopback only (``--host
127.0.0.1``, ``front.upstream_port``). Its worker API (``/remove_worker``, ``/workers``, ...) is served on
that port without a key, so the front (``pdfleet-runtime router-front --router vllm``) takes the router
port and passes only vllm-router's serving routes; the worker API answers 404 there and stays on the pod's
loopback (docs/vllm.md, "Its worker API is behind the front"). On every PD call to a worker it sends
``Authorization: Bearer $OPENAI_API_KEY`` from its environment (seen with 0.1.17: ``--api-key`` reaches only
``/render``), so the router container gets the deployment's worker key in that variable from the worker-key
Secret (``secretKeyRef``, never on the command line): the built-in runtime's worker API requires it, a vLLM
started with ``--api-key`` would check it. A new key reaches it at the router pod's next start. The built-in
runtime's prefill pods carry the ``vllm.ai/bootstrap-port`` annotation its discovery reads (Mooncake's
bootstrap, where it asks ``/query`` for the engine id) and run with ``--pin-engine-id`` (the pod's name: a
container restarted in place keeps the id the router read once). Probes as sglang-router's: readiness through the front to
the router's ``/readiness``, liveness on the router's metrics port, its only listener off the loopback
(tests/unit/operator/test_router.py names the source lines).
"""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, RouterKind
from pdfleet_operator.resources.names import SECRET_FILE, worker_secret_name
from pdfleet_operator.resources.plugins.contract import RouterDiscovery
from pdfleet_operator.resources.plugins.front import fronted_router_containers, upstream_port
from pdfleet_operator.resources.plugins.vllm import ANNOTATION_VLLM_BOOTSTRAP_PORT
from pdfleet_runtime.config import BOOTSTRAP_PORT
from pdfleet_runtime.front.routers import FrontedRouter

__all__ = ["VLLM_ROUTER", "WORKER_KEY_ENV", "VllmRouter", "vllm_router_command"]

WORKER_KEY_ENV = "OPENAI_API_KEY"
"""Where vllm-router 0.1.17 reads the key it sends workers (``Authorization: Bearer $OPENAI_API_KEY``)."""


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
        containers = fronted_router_containers(deployment, spec, FrontedRouter.VLLM,
                                               vllm_router_command(spec, discovery), security)
        key = {"secretKeyRef": {"name": worker_secret_name(deployment), "key": SECRET_FILE}}
        containers[0]["env"] = [{"name": WORKER_KEY_ENV, "valueFrom": key}]
        return containers

    def volumes(self, deployment: str) -> list[dict]:
        return []

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        return None

    def worker_annotations(self, role: Role) -> dict[str, str]:
        return {ANNOTATION_VLLM_BOOTSTRAP_PORT: str(BOOTSTRAP_PORT)} if role is Role.PREFILL else {}

    def worker_args(self, role: Role) -> list[str]:
        # It reads a prefill's Mooncake engine id once per worker: a container restarted in place (same pod, same
        # address) must keep it, or every transfer to it fails until the router restarts.
        return ["--pin-engine-id"] if role is Role.PREFILL else []


VLLM_ROUTER = VllmRouter()
