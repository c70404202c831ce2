"""The router role's objects: what ``spec.router`` renders, and what it must not grant.

The router itself is exercised for real in tests/cluster/test_router.py; these pin the rendering.
"""

from __future__ import annotations

import base64
import copy
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, desired_children, plan
from pdfleet_operator.resources.names import router_name, router_secret_name, worker_secret_name
from pdfleet_operator.resources.plugins.front import FRONT_CONTAINER, front_command, upstream_port
from pdfleet_operator.resources.plugins.registry import ROUTERS
from pdfleet_operator.resources.plugins.sglang_router import CONTROL_PLANE_KEY
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.policy import OPERATOR_LABELS
from pdfleet_operator.resources.router import (
    LABEL_ROUTER,
    ROUTER_CONTAINER,
    router_command,
    router_deployment,
    scrape_port,
)
from pdfleet_operator.status import compute_status, status_document
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.config import BOOTSTRAP_PORT, HTTP_PORT, METRICS_PORT
from pdfleet_runtime.engine_rules.sglang import ENGINE_PORT
from pdfleet_runtime.front.routers import SURFACES, FrontedRouter

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
OWNER = Owner(name="demo", namespace="ns", uid="uid-1")
ROUTER = {"image": "ghcr.io/pdfleet/runtime:0.1.0"}


def _doc(name: str = "llama-dense.yaml", router: dict | None = ROUTER) -> dict:
    doc = yaml.safe_load((EXAMPLES / "valid" / name).read_text())
    if router is not None:
        doc["spec"]["router"] = copy.deepcopy(router)
    return doc


def _spec(doc: dict) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(doc["spec"])


def _by_kind(objs: list[dict], kind: str, name: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _flag(cmd: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next flag."""
    i = cmd.index(flag) + 1
    out = []
    while i < len(cmd) and not cmd[i].startswith("--"):
        out.append(cmd[i])
        i += 1
    return out


def test_no_router_renders_no_router_objects_and_no_endpoint() -> None:
    spec = _spec(_doc(router=None))
    objs = desired_children(OWNER, spec)
    assert not [o for o in objs if o["metadata"]["name"] == router_name("demo")]
    assert not [a for a in plan(OWNER, spec, Snapshot()) if a.name == router_secret_name("demo")]
    assert "endpoint" not in status_document(
        compute_status(spec, "demo", 1, [], None, [], datetime.now(UTC), namespace="ns"))
    # Removing spec.router clears a stale endpoint (merge patch with null).
    cleared = status_document(compute_status(spec, "demo", 1, [], PDDeploymentStatus(endpoint="http://x"), [],
                                             datetime.now(UTC), namespace="ns"))
    assert cleared["endpoint"] is None


def test_router_command_discovers_only_routable_pods_of_its_deployment() -> None:
    spec = _spec(_doc(router={**ROUTER, "prefillPolicy": "round_robin", "decodePolicy": "power_of_two",
                              "port": 31000, "metricsPort": 31001}))
    full = router_command("demo", "ns", spec)
    assert full[:2] == ["pdfleet-runtime", "router-launch"]
    cmd = full[full.index("--") + 1:]  # sglang_router.launch_router's own arguments
    assert "--pd-disaggregation" in cmd and "--service-discovery" in cmd
    assert _flag(cmd, "--service-discovery-namespace") == ["ns"]
    assert _flag(cmd, "--service-discovery-port") == [str(HTTP_PORT)]
    for role, flag in ((Role.PREFILL, "--prefill-selector"), (Role.DECODE, "--decode-selector")):
        # Not the routable label: the router would miss the deletion of a relabelled pod (router.py).
        assert _flag(cmd, flag) == ["pdfleet.io/deployment=demo", f"pdfleet.io/role={role.value}"]
        # The selector matches the pods the operator creates.
        labels = runtime_pod("demo", "ns", spec, role, "r" * 10, 0)["metadata"]["labels"]
        assert all(labels[k] == v for k, v in (kv.split("=") for kv in _flag(cmd, flag)))
    assert _flag(cmd, "--prefill-policy") == ["round_robin"] and _flag(cmd, "--decode-policy") == ["power_of_two"]
    # The router listens on the pod's loopback; the front takes the router port; metrics on their own port.
    assert _flag(cmd, "--host") == ["127.0.0.1"] and _flag(cmd, "--port") == [str(upstream_port(spec.router))]
    assert upstream_port(spec.router) not in (31000, 31001)
    assert _flag(cmd, "--prometheus-port") == ["31001"]
    # No key on a command line (issue 39): the launcher reads both from the mounted Secrets.
    assert not {"--api-key", "--control-plane-api-keys"} & set(full)
    assert _flag(full, "--api-key-file") == ["/var/run/pdfleet/worker-auth/key"]
    assert _flag(full, "--control-plane-keys-file") == [f"/var/run/pdfleet/router-keys/{CONTROL_PLANE_KEY}"]
    front = front_command("demo", spec, FrontedRouter.SGLANG)
    assert _flag(front, "--router") == ["sglang"] and _flag(front, "--listen") == ["0.0.0.0:31000"]
    assert _flag(front, "--upstream") == [f"http://127.0.0.1:{upstream_port(spec.router)}"]
    assert _flag(front, "--served-model") == ["demo"]  # spec.model.servedName unset: the deployment's name
    assert _flag(front, "--api-key-file") == ["/var/run/pdfleet/worker-auth/key"]  # sglang-router wants the key


def test_sglang_workers_are_reached_on_the_engine_port() -> None:
    spec = _spec(_doc("sglang-deepseek-mla.yaml"))
    assert _flag(router_command("demo", "ns", spec), "--service-discovery-port") == [str(ENGINE_PORT)]
    policy = _by_kind(desired_children(OWNER, spec), "NetworkPolicy", "demo-transfer")
    assert {"from": [{"podSelector": {"matchLabels": {LABEL_ROUTER: "demo"}}}],
            "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]} in policy["spec"]["ingress"]
    # the autoscaler reads the engine's own /metrics on its worker port: the operator's pods are admitted there
    assert {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_LABELS}}],
            "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]} in policy["spec"]["ingress"]


def test_router_objects_are_owned_least_privilege_and_wired_together() -> None:
    spec = _spec(_doc(router={**ROUTER, "replicas": 3}))
    actions = plan(OWNER, spec, Snapshot())
    objs = [a.body for a in actions if a.kind is ActionKind.APPLY]
    name = router_name("demo")
    role = _by_kind(objs, "Role", name)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = _by_kind(objs, "RoleBinding", name)
    assert binding["roleRef"]["name"] == name and binding["subjects"][0]["name"] == name
    dep = _by_kind(objs, "Deployment", name)
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == name
    # Router pods do not carry the deployment label: that would admit them to the engines' data ports.
    assert "pdfleet.io/deployment" not in pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    router, front = pod["spec"]["containers"]
    assert (router["name"], front["name"]) == (ROUTER_CONTAINER, FRONT_CONTAINER)
    assert "env" not in router and "env" not in front  # keys come from files, not the environment
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"]}
    assert volumes == {"worker-auth": worker_secret_name("demo"), "router-keys": router_secret_name("demo")}
    assert {m["name"] for m in router["volumeMounts"]} == {"worker-auth", "router-keys"}
    assert {m["name"] for m in front["volumeMounts"]} == {"worker-auth"}  # the front never holds the admin key
    assert all(m["readOnly"] for c in (router, front) for m in c["volumeMounts"])
    assert [p["containerPort"] for p in front["ports"]] == [30000] and front["readinessProbe"]["httpGet"]["port"] == "http"
    svc = _by_kind(objs, "Service", name)
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == 30000
    for o in objs:
        assert o["metadata"]["ownerReferences"] == [OWNER.reference()]
    # The workers' HTTP port: from the routers and the deployment's own pods, not from anywhere.
    workers = _by_kind(objs, "NetworkPolicy", "demo-transfer")["spec"]["ingress"]
    assert all(rule.get("from") for rule in workers)
    assert {"from": [{"podSelector": {"matchLabels": {LABEL_ROUTER: "demo"}}}],
            "ports": [{"protocol": "TCP", "port": HTTP_PORT}]} in workers
    # the metrics port (/metrics alone) from the operator's pods, in whichever namespace: its autoscaler scrapes there
    assert {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_LABELS}}],
            "ports": [{"protocol": "TCP", "port": METRICS_PORT}]} in workers
    assert scrape_port(spec) == METRICS_PORT


def test_vllm_router_listens_on_loopback_behind_the_front() -> None:
    """vllm-router 0.1.17 serves its worker API (/add_worker, /remove_worker, /list_workers, /flush_cache,
    /get_loads, /finish_session, POST /workers, DELETE /workers/{url}: src/server.rs:930-944 of its sdist) on
    its ``--host:--port`` without a key (``authorize_request``, :478-485, passes every request when no
    validation URL is set; the Python launcher sets none: src/lib.rs:319). So it binds the pod's loopback
    (``--host``, vllm_router/router_args.py) and the front takes the router port, passing only its serving
    routes. /liveness answers 200 while the process serves (src/routers/mod.rs:182-186); /readiness 200 with
    at least one healthy prefill and one healthy decode, else 503 (src/routers/http/pd_router.rs:1616-1667,
    which vllm_pd_router.rs:2969-2971 delegates to): the readiness probe goes through the front to it. The
    router's only listener off the loopback is its Prometheus exporter (every path answers with the
    metrics): its liveness. tests/vllm/test_vllm_router_probes.py runs both processes as rendered."""
    spec = _spec(_doc("vllm-qwen3.8-flash-next-nixl.yaml", router=None))
    assert spec.router is not None
    pod = router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]
    router, front = pod["containers"]
    assert (router["name"], front["name"]) == (ROUTER_CONTAINER, FRONT_CONTAINER)
    assert router["command"][0] == "vllm-router" and front["image"] == router["image"]
    loopback = upstream_port(spec.router)
    assert loopback not in (spec.router.port, spec.router.metrics_port)
    assert _flag(router["command"], "--host") == ["127.0.0.1"] and _flag(router["command"], "--port") == [str(loopback)]
    assert [p["name"] for p in router["ports"]] == ["metrics"]  # nothing of the router's on the serving port
    assert _flag(router["command"], "--prometheus-port") == [str(router["ports"][0]["containerPort"])]
    assert router["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert "readinessProbe" not in router
    # The front: the router port (the Service's target), vllm-router's routes, no worker key, no Secret.
    assert front["ports"] == [{"name": "http", "containerPort": spec.router.port, "protocol": "TCP"}]
    assert front["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    cmd = front["command"]
    assert cmd[:2] == ["pdfleet-runtime", "router-front"] and _flag(cmd, "--router") == ["vllm"]
    assert _flag(cmd, "--listen") == [f"0.0.0.0:{spec.router.port}"]
    assert _flag(cmd, "--upstream") == [f"http://127.0.0.1:{loopback}"]
    assert "--api-key-file" not in cmd and "volumeMounts" not in front and not pod.get("volumes")
    routes = SURFACES[FrontedRouter.VLLM].routes
    assert {"/v1/chat/completions", "/v1/completions"} <= routes["POST"]
    assert {"/v1/models", "/health", "/readiness", "/liveness"} <= routes["GET"]
    worker_api = {"/add_worker", "/remove_worker", "/list_workers", "/flush_cache", "/get_loads", "/finish_session",
                  "/workers", "/scheduling/diagnostics"}
    assert not worker_api & (routes["POST"] | routes["GET"]) and set(routes) == {"POST", "GET"}


def test_vllm_router_fronts_the_builtin_runtime_with_the_worker_key_and_the_bootstrap_annotation() -> None:
    """The built-in runtime speaks vLLM's PD contract too, so its fleets take either router kind (an SGLang
    fleet only sglang-router). vllm-router 0.1.17 sends ``Authorization: Bearer $OPENAI_API_KEY`` on every
    PD call (seen against loopback stand-ins: ``--api-key`` reached only ``/render``), so its container gets the
    worker key in that variable from the worker-key Secret, never on its command line; the runtime's prefill
    pods carry the ``vllm.ai/bootstrap-port`` its discovery reads (Mooncake's ``/query``)."""
    doc = _doc(router={**ROUTER, "kind": "vllm"})
    assert validate_object(doc).admitted, validate_object(doc).violations
    spec = _spec(doc)
    pod = router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]
    router = pod["containers"][0]
    assert router["command"][0] == "vllm-router"
    assert router["env"] == [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": worker_secret_name("demo"), "key": "key"}}}]
    assert not any("key" in arg.lower() for arg in router["command"])
    prefill = runtime_pod("demo", "ns", spec, Role.PREFILL, "r1", 0)["metadata"]["annotations"]
    decode = runtime_pod("demo", "ns", spec, Role.DECODE, "r1", 0)["metadata"]["annotations"]
    assert prefill["vllm.ai/bootstrap-port"] == str(BOOTSTRAP_PORT) and "vllm.ai/bootstrap-port" not in decode
    # The prefill's engine id is its pod's name: a container restarted in place keeps the id the router read once.
    commands = {r: runtime_pod("demo", "ns", spec, r, "r1", 0)["spec"]["containers"][0]["command"] for r in Role}
    assert "--pin-engine-id" in commands[Role.PREFILL] and "--pin-engine-id" not in commands[Role.DECODE]
    # sglang-router on the same fleet: no annotation of vLLM's; on an SGLang fleet vllm-router is denied.
    sglang = runtime_pod("demo", "ns", _spec(_doc()), Role.PREFILL, "r1", 0)["metadata"]["annotations"]
    assert "vllm.ai/bootstrap-port" not in sglang
    assert "--pin-engine-id" not in runtime_pod("demo", "ns", _spec(_doc()), Role.PREFILL, "r1", 0)["spec"][
        "containers"][0]["command"]
    sg = _doc("sglang-qwen3.8-flash-next.yaml", router={**ROUTER, "kind": "vllm"})
    assert [v.rule for v in validate_object(sg).violations] == ["router-kind-engine"]


def test_every_router_kind_has_a_front() -> None:
    """The front's kinds are the router kinds; each router plug-in renders the front of its own kind."""
    assert {r.value for r in FrontedRouter} == {k.value for k in ROUTERS}
    for doc, kind in (("llama-dense.yaml", "sglang"), ("vllm-qwen3.8-flash-next-nixl.yaml", "vllm")):
        spec = _spec(_doc(doc))
        [front] = [c for c in router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"]
                   if c["name"] == FRONT_CONTAINER]
        assert _flag(front["command"], "--router") == [kind]


def test_router_secret_is_created_once_with_an_admin_key() -> None:
    spec = _spec(_doc())
    [create] = [a for a in plan(OWNER, spec, Snapshot()) if a.name == router_secret_name("demo")]
    assert create.kind is ActionKind.CREATE
    kid, name, role, key = base64.b64decode(create.body["data"][CONTROL_PLANE_KEY]).decode().split(":")
    assert role == "admin" and len(key) >= 32 and kid and name
    again = plan(OWNER, spec, Snapshot(secret_exists=True, router_secret_exists=True, worker_secret_exists=True))
    assert not [a for a in again if a.object_kind == "Secret"]


def test_endpoint_in_status() -> None:
    spec = _spec(_doc(router={**ROUTER, "port": 8000}))
    status = compute_status(spec, "demo", 1, [], None, [], datetime.now(UTC), namespace="ns")
    assert status.endpoint == "http://demo-router.ns.svc:8000"


@pytest.mark.parametrize(("router", "field"), [
    ({**ROUTER, "port": 9000, "metricsPort": 9000}, "router-ports-distinct"),
    ({**ROUTER, "prefillPolicy": "fastest"}, "prefillPolicy"),
    ({"replicas": 1}, "image"),
])
def test_bad_router_spec_is_denied_naming_the_field(router: dict, field: str) -> None:
    verdict = validate_object(_doc(router=router), "test")
    assert not verdict.admitted
    assert field in str(verdict), str(verdict)
