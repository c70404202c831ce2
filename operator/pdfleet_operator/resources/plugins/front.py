"""pdfleet's front in a router pod, for every router kind: the container on the router port (the Service's).

The router itself listens on the pod's loopback only (``upstream_port``); the front (``pdfleet-runtime
router-front``, ``pdfleet_runtime.front``) takes the router port and passes only the router kind's serving
routes (``pdfleet_runtime.front.routers.SURFACES``), the served model only, and the worker key where the
kind wants it. Its readiness probe goes through it to the router's ``/readiness``. It runs from the router
image, which therefore holds pdfleet-runtime beside the router. Router plug-ins call ``front_container``;
nothing here names one.
"""

from __future__ import annotations

from pdfleet_operator.api.models import PDDeploymentSpec, RouterSpec
from pdfleet_operator.resources.names import SECRET_FILE, WORKER_SECRET_MOUNT
from pdfleet_operator.resources.plugins.contract import ROUTER_CONTAINER
from pdfleet_runtime.front.routers import ROUTER_PRESTOP_S, SURFACES, FrontedRouter

__all__ = ["FRONT_CONTAINER", "front_command", "front_container", "fronted_router_containers", "upstream_port",
           "worker_key_mount"]

FRONT_CONTAINER = "front"


def worker_key_mount() -> dict:
    """The worker-key Secret's mount (the pod's ``worker-auth`` volume), where a router kind wants the key."""
    return {"name": "worker-auth", "mountPath": WORKER_SECRET_MOUNT, "readOnly": True}


def upstream_port(router: RouterSpec) -> int:
    """Where the router listens, on the pod's loopback only (the front takes the router port)."""
    return next(p for p in (router.port + 1, router.port + 2, router.port - 1) if p != router.metrics_port
                and 0 < p < 65536)


def front_command(deployment: str, spec: PDDeploymentSpec, kind: FrontedRouter) -> list[str]:
    """The front on the router port: the kind's serving routes, the served model only, the worker key added
    where the kind wants it."""
    router = spec.router
    assert router is not None
    key = ["--api-key-file", f"{WORKER_SECRET_MOUNT}/{SECRET_FILE}"] if SURFACES[kind].worker_key else []
    return [
        "pdfleet-runtime", "router-front",
        "--router", kind.value,
        "--listen", f"0.0.0.0:{router.port}",
        "--upstream", f"http://127.0.0.1:{upstream_port(router)}",
        "--served-model", spec.model.served_name or deployment,
        *key,
    ]


def front_container(deployment: str, spec: PDDeploymentSpec, kind: FrontedRouter, security: dict) -> dict:
    """The front's container: the ``http`` port (the Service's target); ready once it and the router answer."""
    router = spec.router
    assert router is not None
    mounts = {"volumeMounts": [worker_key_mount()]} if SURFACES[kind].worker_key else {}
    return {
        "name": FRONT_CONTAINER,
        "image": router.image,
        "command": front_command(deployment, spec, kind),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        **mounts,
        # Through the front to the router: ready once both answer.
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
        "securityContext": security,
    }


def fronted_router_containers(deployment: str, spec: PDDeploymentSpec, kind: FrontedRouter, command: list[str],
                              security: dict, mounts: list[dict] | None = None) -> list[dict]:
    """The router's container (its serving port on the pod's loopback, the front's upstream) and the front's."""
    router = spec.router
    assert router is not None
    container = {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "command": command,
        "ports": [{"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"}],
        **({"volumeMounts": mounts} if mounts else {}),
        # Its serving port is on loopback (the front's upstream); its metrics listener says it is alive.
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5,
                          "failureThreshold": 6},
        "resources": router.resources.model_dump(by_alias=True, exclude_none=True, mode="json"),
        # Up until the front has drained (it gets SIGTERM at once and serves while clients still reach it).
        "lifecycle": {"preStop": {"exec": {"command": ["pdfleet-runtime", "router-front-wait", "--port",
                                                       str(router.port), "--within", str(ROUTER_PRESTOP_S)]}}},
        "securityContext": security,
    }
    return [container, front_container(deployment, spec, kind, security)]
