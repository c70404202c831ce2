"""The router role: router pods behind a Service, the deployment's one endpoint.

What runs in the router pod is the router kind's (``spec.router.kind``, defaulting to the engine's own
router: one plug-in per ``RouterKind`` in ``resources.plugins``, with its containers and Secret); this
module renders what every kind shares: discovery (``RouterDiscovery``: the roles' selectors, the workers'
port from the engine kind's worker contract, the health-check timings), the Deployment, Service,
ServiceAccount, Role and NetworkPolicy.

A router lists and watches every pod of the namespace and filters labels itself, so its Role is
get/list/watch on pods and nothing else. Its discovery adds a matching pod once it is Running and Ready
and removes it only when the pod is deleted: it ignores a label change and a pod going not-ready
(measured in tests/cluster/test_router.py; docs/router.md). What takes a draining pod out of the router's
worker set is the router's own health check: a worker whose ``/health`` fails ``HEALTH_FAILURES`` checks
``HEALTH_INTERVAL_S`` apart gets no new requests, so a draining worker answers ``/health`` 503 and keeps
admitting for ``ROUTER_DROP_BOUND_S`` before it refuses new work. The selectors leave out
``pdfleet.io/routable``: the router filters watch events by its selector, so the deletion of a pod
relabelled unroutable would go unseen and its worker stay listed (measured too).

Router pods carry their own label (``pdfleet.io/router``), not the deployment label: the workers'
NetworkPolicy admits the deployment's pods on every port (the engines' data ports), and routers must
reach only the workers' HTTP port.
"""

from __future__ import annotations

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, LABEL_ROLE, Role
from pdfleet_operator.api.models import PDDeploymentSpec, RouterSpec
from pdfleet_operator.observed import Generation
from pdfleet_operator.resources.names import (
    ANNOTATION_DECODE_COMPAT,
    ANNOTATION_PREFILL_COMPAT,
    LABEL_COMPAT,
    LABEL_MEMBER,
    MANAGED_BY,
    owner_labels,
    router_name,
)
from pdfleet_operator.resources.plugins.contract import ROUTER_CONTAINER, RouterDiscovery
from pdfleet_operator.resources.plugins.registry import engine_plugin, router_kind, router_plugin
from pdfleet_runtime.config import METRICS_PORT

__all__ = [
    "HEALTH_FAILURES",
    "LABEL_ROUTER",
    "ROUTER_CONTAINER",
    "ROUTER_DROP_BOUND_S",
    "endpoint_url",
    "router_children",
    "router_command",
    "router_deployment",
    "router_discovery",
    "router_kind",
    "router_labels",
    "router_network_policy",
    "router_role",
    "router_role_binding",
    "router_service",
    "router_service_account",
    "scrape_port",
    "worker_port",
]

LABEL_ROUTER = f"{GROUP}/router"
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
    """The workers' HTTP port the router sends requests to: the engine kind's worker contract."""
    return engine_plugin(spec).worker.port


def scrape_port(spec: PDDeploymentSpec) -> int:
    """Where the operator (the autoscaler) reads a worker pod's ``/metrics``: the built-in runtime's metrics port
    (nothing else is served there), or an engine's worker port, where the engine serves its own metrics."""
    return METRICS_PORT if engine_plugin(spec).container is None else worker_port(spec)


# app.kubernetes.io/name of every router pod, whatever its kind: the name the first router kind gave them,
# kept so that selectors on it (dashboards, policies) still match; a kind-specific name would be a visible change.
ROUTER_APP_NAME = "sglang-router"


def router_labels(deployment: str) -> dict[str, str]:
    return {
        LABEL_ROUTER: deployment,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": ROUTER_APP_NAME,
        "app.kubernetes.io/component": "router",
    }


def _meta(name: str, namespace: str, deployment: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": owner_labels(deployment)}


def endpoint_url(deployment: str, namespace: str, router: RouterSpec) -> str:
    return f"http://{router_name(deployment)}.{namespace}.svc:{router.port}"


def _selector(deployment: str, role: Role, spec: PDDeploymentSpec, generation: Generation | None) -> tuple[str, ...]:
    """The role's pods; where its replicas span nodes, each group's leader only (the worker the router sends
    to: the members serve no worker API); with a generation, only the pods of its compatibility key."""
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    terms = [f"{LABEL_DEPLOYMENT}={deployment}", f"{LABEL_ROLE}={role.value}"]
    if rs.parallelism.nodes_per_replica > 1:
        terms.append(f"{LABEL_MEMBER}=0")
    if generation is not None:
        terms.append(f"{LABEL_COMPAT}={generation.of(role)}")
    return tuple(terms)


def router_discovery(deployment: str, namespace: str, spec: PDDeploymentSpec,
                     generation: Generation | None = None) -> RouterDiscovery:
    """What every router kind discovers: each role's pods in the namespace (selectors as ``key=value`` terms;
    with ``generation``, of its compatibility keys only: ``generations``), on the engine kind's worker port,
    with the health-check timings above."""
    return RouterDiscovery(
        namespace=namespace,
        worker_port=worker_port(spec),
        prefill_selector=_selector(deployment, Role.PREFILL, spec, generation),
        decode_selector=_selector(deployment, Role.DECODE, spec, generation),
        health_interval_s=HEALTH_INTERVAL_S,
        health_failures=HEALTH_FAILURES,
        health_timeout_s=HEALTH_TIMEOUT_S,
        startup_check_s=STARTUP_CHECK_S,
    )


def router_command(deployment: str, namespace: str, spec: PDDeploymentSpec,
                   generation: Generation | None = None) -> list[str]:
    """The router kind's command line, with Kubernetes discovery of the deployment's routable pods."""
    return router_plugin(spec).command(deployment, namespace, spec,
                                       router_discovery(deployment, namespace, spec, generation))


def router_deployment(deployment: str, namespace: str, spec: PDDeploymentSpec,
                      generation: Generation | None = None) -> dict:
    """The router pods: the kind's containers and volumes, under one non-root, no-capability security context;
    the generation its selectors carry in its annotations (the operator reads them back)."""
    router = spec.router
    assert router is not None
    security = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    plugin = router_plugin(spec)
    discovery = router_discovery(deployment, namespace, spec, generation)
    containers = plugin.containers(deployment, namespace, spec, discovery, security)
    body = _router_deployment(deployment, namespace, router, containers, plugin.volumes(deployment))
    if generation is not None:
        body["metadata"]["annotations"] = {ANNOTATION_PREFILL_COMPAT: generation.prefill,
                                           ANNOTATION_DECODE_COMPAT: generation.decode}
    return body


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


def router_children(deployment: str, namespace: str, spec: PDDeploymentSpec,
                    generation: Generation | None = None) -> list[dict]:
    """Every applied router object (the Secret is created once, by ``plan``); none without spec.router."""
    if spec.router is None:
        return []
    return [
        router_service_account(deployment, namespace),
        router_role(deployment, namespace),
        router_role_binding(deployment, namespace),
        router_service(deployment, namespace, spec.router),
        router_network_policy(deployment, namespace, spec.router),
        router_deployment(deployment, namespace, spec, generation),
    ]
