"""The router role: sglang-router pods behind a Service, the deployment's one endpoint.

The router (``sglang-router==0.3.2``) lists and watches every pod of the namespace and filters
labels itself, so its Role is get/list/watch on pods and nothing else. Its discovery adds a matching
pod once it is Running and Ready and removes it only when the pod is deleted: it ignores a label
change and a pod going not-ready (measured in tests/cluster/test_router.py; docs/router.md). What
takes a draining pod out of the router's worker set is the router's own health check: a worker
whose ``/health`` fails ``HEALTH_FAILURES`` checks ``HEALTH_INTERVAL_S`` apart gets no new requests,
so a draining worker answers ``/health`` 503 and keeps admitting for ``ROUTER_DROP_BOUND_S`` before
it refuses new work. The selectors leave out ``pdfleet.io/routable``: the router filters watch
events by its selector, so the deletion of a pod relabelled unroutable would go unseen and its
worker stay listed (measured too).

Its control endpoints (``/workers`` registers a worker that would then receive prompts) are
locked with an admin API key from a per-deployment Secret, passed as ``$(VAR)`` through env so the
key never appears in the pod spec. Router pods carry their own label (``pdfleet.io/router``), not
the deployment label: the workers' NetworkPolicy admits the deployment's pods on every port (the
engines' data ports), and routers must reach only the workers' HTTP port.
"""

from __future__ import annotations

import base64
import secrets

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, LABEL_ROLE, Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec, RouterKind, RouterSpec
from pdfleet_operator.resources.names import (
    LABEL_MEMBER,
    MANAGED_BY,
    SECRET_FILE,
    WORKER_SECRET_MOUNT,
    owner_labels,
    router_name,
    router_secret_name,
    worker_secret_name,
)
from pdfleet_runtime.config import HTTP_PORT
from pdfleet_runtime.engine_rules.sglang import ENGINE_PORT

__all__ = [
    "CONTROL_PLANE_KEY",
    "FRONT_CONTAINER",
    "HEALTH_FAILURES",
    "LABEL_ROUTER",
    "ROUTER_CONTAINER",
    "ROUTER_DROP_BOUND_S",
    "endpoint_url",
    "front_command",
    "router_children",
    "router_command",
    "router_deployment",
    "router_kind",
    "router_labels",
    "router_network_policy",
    "router_role",
    "router_role_binding",
    "router_secret",
    "router_service",
    "router_service_account",
    "upstream_port",
    "vllm_router_command",
    "worker_port",
]

LABEL_ROUTER = f"{GROUP}/router"
ROUTER_CONTAINER = "router"
CONTROL_PLANE_KEY = "control-plane-api-keys"  # the Secret's key: 'id:name:role:secret' for --control-plane-api-keys
ROUTER_KEYS_MOUNT = "/var/run/pdfleet/router-keys"
FRONT_CONTAINER = "front"
KEY_ID, KEY_NAME = "pdfleet", "pdfleet-operator"
# The check's timeout is 2 s, not 1: on a busy node a healthy worker's /health can take over a second, and
# two slow answers in a row marked the only new prefill unhealthy while the old one drained (every request
# then answered 503 "all circuits open or unhealthy" in the e2e suite). A draining worker answers 503 at once.
HEALTH_INTERVAL_S, HEALTH_FAILURES, HEALTH_TIMEOUT_S = 1, 2, 2
# A worker whose /health fails is skipped by every router within this bound: one round of phase between the
# drain and the router's check loop, then the failed checks. A round lasts the interval or, when any worker
# the router holds does not answer, the timeout: 0.3.2's loop waits for its slowest check, and its discovery
# never removes a pod that was not Ready when deleted (a drained pod), so unreachable workers are the usual
# case after a rollout (the e2e suite's router logs: every worker checked every 3 s with a 3 s timeout).
ROUTER_DROP_BOUND_S = (HEALTH_FAILURES + 1) * max(HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S)
# A discovered worker (Running and Ready, so past its gate) whose first registration probe fails (a slow
# /health on a busy node) is probed again after this many seconds; 0.3.2's default, 30 s, left a new
# pod out of the router for half a minute or more after it was Ready.
STARTUP_CHECK_S = 1


def worker_port(spec: PDDeploymentSpec) -> int:
    """The workers' HTTP port the router sends requests to: SGLang's server, or the built-in runtime's."""
    engine = spec.engine is not None and spec.engine.kind in (EngineKind.SGLANG, EngineKind.VLLM)
    return ENGINE_PORT if engine else HTTP_PORT  # vLLM is rendered on SGLang's port


def router_labels(deployment: str) -> dict[str, str]:
    return {
        LABEL_ROUTER: deployment,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": "sglang-router",
        "app.kubernetes.io/component": "router",
    }


def _meta(name: str, namespace: str, deployment: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": owner_labels(deployment)}


def endpoint_url(deployment: str, namespace: str, router: RouterSpec) -> str:
    return f"http://{router_name(deployment)}.{namespace}.svc:{router.port}"


def _selector(deployment: str, role: Role, spec: PDDeploymentSpec) -> str:
    """The role's pods; where its replicas span nodes, each group's leader only (the worker the router sends
    to: the members serve no worker API)."""
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    leaders = f" {LABEL_MEMBER}=0" if rs.parallelism.nodes_per_replica > 1 else ""
    return f"{LABEL_DEPLOYMENT}={deployment} {LABEL_ROLE}={role.value}{leaders}"


def router_kind(spec: PDDeploymentSpec) -> RouterKind:
    """spec.router.kind, defaulting to the engine's own router (admission denies the other engine's)."""
    assert spec.router is not None
    if spec.router.kind is not None:
        return spec.router.kind
    vllm = spec.engine is not None and spec.engine.kind is EngineKind.VLLM
    return RouterKind.VLLM if vllm else RouterKind.SGLANG


def vllm_router_command(deployment: str, namespace: str, spec: PDDeploymentSpec) -> list[str]:
    """vllm-router 0.1.17 in vLLM's PD mode with the connector of spec.transfer.backend and Kubernetes discovery
    of the roles' pods (it reads each prefill's ``vllm.ai/bootstrap-port`` annotation). It has no admin
    API key: its worker list comes from discovery alone."""
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
        "--service-discovery-namespace", namespace,
        "--service-discovery-port", str(worker_port(spec)),
        "--prefill-selector", *_selector(deployment, Role.PREFILL, spec).split(),
        "--decode-selector", *_selector(deployment, Role.DECODE, spec).split(),
        "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
        "--worker-startup-check-interval", str(STARTUP_CHECK_S),
    ]


def upstream_port(router: RouterSpec) -> int:
    """Where sglang-router listens, on the pod's loopback only (the front takes the router port)."""
    return next(p for p in (router.port + 1, router.port + 2, router.port - 1) if p != router.metrics_port
                and 0 < p < 65536)


def router_command(deployment: str, namespace: str, spec: PDDeploymentSpec) -> list[str]:
    """``launch_router`` in PD mode with Kubernetes discovery of the deployment's routable pods, started by
    ``pdfleet-runtime router-launch`` with its keys read from the mounted Secrets (never in the command);
    vllm-router's command for a vLLM fleet."""
    router = spec.router
    assert router is not None
    if router_kind(spec) is RouterKind.VLLM:
        return vllm_router_command(deployment, namespace, spec)
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
        "--service-discovery-namespace", namespace,
        "--service-discovery-port", str(worker_port(spec)),
        "--prefill-selector", *_selector(deployment, Role.PREFILL, spec).split(),
        "--decode-selector", *_selector(deployment, Role.DECODE, spec).split(),
        "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
        "--worker-startup-check-interval", str(STARTUP_CHECK_S),
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
        "metadata": _meta(router_secret_name(deployment), namespace, deployment),
        "data": {CONTROL_PLANE_KEY: base64.b64encode(value.encode()).decode()},
    }


def router_deployment(deployment: str, namespace: str, spec: PDDeploymentSpec) -> dict:
    router = spec.router
    assert router is not None
    resources = router.resources.model_dump(by_alias=True, exclude_none=True, mode="json")
    security = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if router_kind(spec) is RouterKind.VLLM:
        return _router_deployment(deployment, namespace, router, [_vllm_router_container(deployment, namespace,
                                                                                          spec, security)], [])
    worker_key = {"name": "worker-auth", "mountPath": WORKER_SECRET_MOUNT, "readOnly": True}
    container = {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "command": router_command(deployment, namespace, spec),
        "ports": [{"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"}],
        "volumeMounts": [worker_key, {"name": "router-keys", "mountPath": ROUTER_KEYS_MOUNT, "readOnly": True}],
        # Its serving port is on loopback (the front's upstream); its metrics listener says it is alive.
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5,
                          "failureThreshold": 6},
        "resources": resources,
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
    volumes = [
        {"name": "worker-auth", "secret": {"secretName": worker_secret_name(deployment), "defaultMode": 0o440}},
        {"name": "router-keys", "secret": {"secretName": router_secret_name(deployment), "defaultMode": 0o440}},
    ]
    return _router_deployment(deployment, namespace, router, [container, front], volumes)


def _vllm_router_container(deployment: str, namespace: str, spec: PDDeploymentSpec, security: dict) -> dict:
    """vllm-router in its own image, serving the router port itself: it has no admin API to lock and the vLLM
    pods it sends to take no pdfleet worker key, so no launcher and no front (a remaining item of issue 39)."""
    router = spec.router
    assert router is not None
    probe = {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5}
    return {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "command": router_command(deployment, namespace, spec),
        "ports": [
            {"name": "http", "containerPort": router.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "httpGet": {"path": "/liveness", "port": "http"}, "failureThreshold": 6},
        "resources": router.resources.model_dump(by_alias=True, exclude_none=True, mode="json"),
        "securityContext": security,
    }


def _router_deployment(deployment: str, namespace: str, router: RouterSpec, containers: list[dict],
                       volumes: list[dict]) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(router_name(deployment), namespace, deployment),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": {LABEL_ROUTER: deployment}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": router_labels(deployment)},
                "spec": {
                    "serviceAccountName": router_name(deployment),
                    "automountServiceAccountToken": True,  # its discovery lists and watches pods
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                        "fsGroup": 65532},
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }


def router_service(deployment: str, namespace: str, router: RouterSpec) -> dict:
    """The endpoint: a ClusterIP Service of the router pods (status.endpoint)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(router_name(deployment), namespace, deployment),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_ROUTER: deployment},
            "ports": [{"name": "http", "port": router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_service_account(deployment: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(router_name(deployment), namespace, deployment)}


def router_role(deployment: str, namespace: str) -> dict:
    """Only what discovery does: list and watch the namespace's pods (the router filters labels)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(router_name(deployment), namespace, deployment),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def router_role_binding(deployment: str, namespace: str) -> dict:
    sa = router_name(deployment)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(sa, namespace, deployment),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
    }


def router_network_policy(deployment: str, namespace: str, router: RouterSpec) -> dict:
    """Clients reach the router port from anywhere (it is the endpoint), Prometheus the metrics port."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(router_name(deployment), namespace, deployment),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_ROUTER: deployment}},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": router.port},
                                   {"protocol": "TCP", "port": router.metrics_port}]}],
        },
    }


def router_children(deployment: str, namespace: str, spec: PDDeploymentSpec) -> list[dict]:
    """Every applied router object (the Secret is created once, by ``plan``); none without spec.router."""
    if spec.router is None:
        return []
    return [
        router_service_account(deployment, namespace),
        router_role(deployment, namespace),
        router_role_binding(deployment, namespace),
        router_service(deployment, namespace, spec.router),
        router_network_policy(deployment, namespace, spec.router),
        router_deployment(deployment, namespace, spec),
    ]
