"""The router role on the real control plane: sglang-router 0.3.2 run from its rendered command.

The harness's kubelet runs the router pod's two containers verbatim in its pod sandbox (the router,
started by ``pdfleet-runtime router-launch`` with its keys from the mounted Secrets and listening on
the pod's loopback, and the front on the router port), with the pod's own ServiceAccount token and
in-cluster configuration, so the rendering and the router's Role (get/list/watch pods) are what is
tested. The router's control endpoints are reached from inside its pod (its loopback), as an admin
would through ``kubectl port-forward``; through the Service the front refuses them. The router objects are
exactly what ``plan`` renders for ``spec.router`` (owner references stripped: no PDDeployment exists
here, and the garbage collector would delete them).

Workers: until the built-in runtime serves the router's worker API (issue 22), the prefill and
decode pods here are a STAND-IN (``STAND_IN``): a tiny HTTP server answering the GETs the router
registers workers with (/health, /server_info, /model_info). They carry the labels ``runtime_pod``
gives real pods, so the router's selectors are checked against the operator's own labels.
"""

from __future__ import annotations

import base64
import json
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.kubelet import Kubelet, wait
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.names import (
    LABEL_COMPAT,
    LABEL_ROUTABLE,
    pod_labels,
    router_name,
    worker_secret_name,
)
from pdfleet_operator.resources.plugins.front import upstream_port
from pdfleet_operator.resources.plugins.sglang_router import CONTROL_PLANE_KEY
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from pdfleet_runtime.config import HTTP_PORT, READINESS_GATE

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEST_LABEL = {"pdfleet.io/test": "router"}
PY = sys.executable
NAME = "rt"

STAND_IN = textwrap.dedent("""
    # STAND-IN for the built-in runtime's worker API (issue 22): only what registration reads.
    import http.server, json, os, sys
    role = sys.argv[1]
    answers = {
        "/health": "ok",
        "/server_info": {"disaggregation_mode": role, "model_path": "pdfleet-tests/stand-in"},
        "/model_info": {"model_path": "pdfleet-tests/stand-in", "is_generation": True},
    }
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            print("GET", path, flush=True)
            if path not in answers or (path == "/health" and os.path.exists("/run/state/sick")):
                self.send_response(404); self.end_headers(); return
            body = json.dumps(answers[path]).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[2])), H).serve_forever()
""")


def _spec() -> PDDeploymentSpec:
    doc = yaml.safe_load((EXAMPLES / "valid" / "llama-dense.yaml").read_text())
    doc["spec"]["router"] = {"image": "host", "decodePolicy": "round_robin"}
    return PDDeploymentSpec.model_validate(doc["spec"])


def router_objects(namespace: str) -> list[dict]:
    """What plan renders for the router (and nothing else), owner references stripped."""
    owner = Owner(name=NAME, namespace=namespace, uid="00000000-0000-0000-0000-000000000000")
    out = []
    for a in plan(owner, _spec(), Snapshot(secret_exists=True)):
        body = a.body
        if body is None or a.kind not in (ActionKind.APPLY, ActionKind.CREATE) or body["kind"] == "Pod":
            continue
        if not body["metadata"]["name"].startswith(router_name(NAME)) and body["metadata"]["name"] != \
                worker_secret_name(NAME):
            continue
        body["metadata"].pop("ownerReferences")
        if body["kind"] == "Deployment":  # the test kubelet's selector; nothing else changes
            body["spec"]["template"]["metadata"]["labels"].update(TEST_LABEL)
        out.append(body)
    return out


def worker(role: Role, index: int) -> dict:
    labels = {**pod_labels(NAME, role, "standin000", index), LABEL_COMPAT: compat_key(_spec(), role), **TEST_LABEL}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{NAME}-{role.value}-{index}", "labels": labels},
        "spec": {"terminationGracePeriodSeconds": 2,
                 "containers": [{"name": "worker", "image": "host",
                                 "command": [PY, "/stand-in/worker.py", role.value, str(HTTP_PORT)],
                                 "volumeMounts": [{"name": "code", "mountPath": "/stand-in"},
                                                  {"name": "state", "mountPath": "/run/state"}]}],
                 "volumes": [{"name": "code", "configMap": {"name": "stand-in-worker"}},
                             {"name": "state", "emptyDir": {}}]},
    }


def client_pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "labels": TEST_LABEL},
            "spec": {"containers": [{"name": "main", "image": "host", "command": ["sleep", "3600"]}]}}


def apply(cluster: LocalCluster, namespace: str, *objs: dict) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objs))


@pytest.fixture
def kubelet(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    k = cluster.kubelet(namespace, tmp_path / "pods", selector="pdfleet.io/test=router")
    k.start()
    try:
        yield k
    finally:
        k.shutdown(grace_s=5)


def started(kubelet: Kubelet, prefix: str, timeout: float = 90):  # -> PodSandbox
    return wait(lambda: next((p for p in list(kubelet.pods.values()) if p.name.startswith(prefix) and p.started),
                             None), timeout, f"pod {prefix}* started by the kubelet")


def http(client, method: str, url: str, key: str | None = None, body: dict | None = None) -> tuple[int, str]:
    """curl from inside a pod (the client, or the router for its loopback): (status, body)."""
    cmd = ["curl", "-sS", "--max-time", "5", "-X", method, "-w", "\n%{http_code}", url]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        cmd += ["-H", "content-type: application/json", "-d", json.dumps(body)]
    out = client.exec(*cmd)
    text, _, code = out.stdout.rpartition("\n")
    return (int(code) if code.strip().isdigit() else 0), text or out.stderr


def workers(client, url: str, key: str) -> dict[str, bool]:
    """The router's worker set: url -> is_healthy; empty while the router does not answer."""
    code, text = http(client, "GET", f"{url}/workers", key)
    if code != 200:
        return {}
    return {w["url"]: w["is_healthy"] for w in json.loads(text)["workers"]}


def worker_urls(client, url: str, key: str) -> set[str]:
    return set(workers(client, url, key))


def test_router_discovers_the_deployment_through_its_service_and_refuses_anonymous_control(
        cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    objs = router_objects(namespace)
    assert {o["kind"] for o in objs} == {"ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy",
                                         "Deployment", "Secret"}
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] != worker_secret_name(NAME))
    key = base64.b64decode(secret["data"][CONTROL_PLANE_KEY]).decode().rsplit(":", 1)[1]
    stand_in = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stand-in-worker"},
                "data": {"worker.py": STAND_IN}}
    pods = [worker(Role.PREFILL, 0), worker(Role.DECODE, 0), worker(Role.DECODE, 1)]
    # An unrelated pod with a worker's labels but another deployment: the router must not pick it up.
    stray = worker(Role.DECODE, 9)
    stray["metadata"]["labels"]["pdfleet.io/deployment"] = "other"
    stray["metadata"]["name"] = "other-decode-9"
    apply(cluster, namespace, stand_in, *objs, *pods, stray, client_pod())
    router, client = started(kubelet, router_name(NAME) + "-"), started(kubelet, "client")
    ips = {p["metadata"]["name"]: started(kubelet, p["metadata"]["name"]).ip for p in [*pods, stray]}
    svc = json.loads(cluster.kubectl("-n", namespace, "get", "svc", router_name(NAME), "-o", "json").stdout)
    front = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
    assert _spec().router is not None
    url = f"http://127.0.0.1:{upstream_port(_spec().router)}"  # the router itself, on its pod's loopback
    expected = {f"http://{ips[p['metadata']['name']]}:{HTTP_PORT}" for p in pods}
    try:
        wait(lambda: worker_urls(router, url, key) == expected, 120, "the router's /workers = the deployment's pods")
    except AssertionError as e:
        raise AssertionError(f"{e}: got {worker_urls(router, url, key)} want {expected}; router log:\n"
                             f"{kubelet.log_of(router.name)[-4000:]}") from None
    # The router asks a hub for each worker's tokenizer (a model_path like a hub id, as SGLang reports one): the local
    # cluster's image points it at the loopback, so no attempt leaves (local traffic only).
    wait(lambda: "Failed to load tokenizer" in kubelet.log_of(router.name), 30, "the router's tokenizer attempt")
    log = kubelet.log_of(router.name)
    assert "huggingface.co" not in log and "127.0.0.1:9" in log, log[-3000:]
    # By the Service's name too (CoreDNS), as status.endpoint says: the front passes /health to the router.
    wait(lambda: http(client, "GET", f"http://{router_name(NAME)}.{namespace}.svc:30000/health")[0] == 200, 30,
         "/health through the Service and the front")
    # Control endpoints: through the Service the front refuses them, even with the admin key; on the router's
    # loopback anonymous or wrong-key registration is refused and registers nothing.
    rogue = {"url": f"http://{ips['other-decode-9']}:{HTTP_PORT}", "worker_type": "decode"}
    assert http(client, "POST", f"{front}/workers", key, rogue)[0] == 404
    assert http(client, "GET", f"{front}/workers", key)[0] == 404
    assert http(router, "POST", f"{url}/workers", None, rogue)[0] == 401
    assert http(router, "POST", f"{url}/workers", "wrong-key", rogue)[0] == 401
    assert http(router, "GET", f"{url}/workers")[0] == 401
    assert worker_urls(router, url, key) == expected

    # What takes a pod out of the router (sglang-router 0.3.2), measured: see resources/router.py.
    drained = pods[2]["metadata"]["name"]
    drained_url = f"http://{ips[drained]}:{HTTP_PORT}"
    # 1. The drain's label flip: not in the router's selectors, the pod stays a worker (its deletion is seen).
    cluster.kubectl("-n", namespace, "label", "pod", drained, f"{LABEL_ROUTABLE}=false", "--overwrite")
    time.sleep(3)
    assert workers(router, url, key).get(drained_url) is True
    # 2. The worker's /health failing: the router's health check marks it unhealthy (no new requests).
    sandbox = started(kubelet, drained)
    t0 = time.monotonic()
    sandbox.exec("touch", "/run/state/sick")
    wait(lambda: workers(router, url, key).get(drained_url) is False, 30, "the router marked the pod unhealthy")
    unhealthy_s = time.monotonic() - t0
    # 3. Deletion (the drain's end): discovery removes the worker on the deletion timestamp.
    t0 = time.monotonic()
    cluster.kubectl("-n", namespace, "delete", "pod", drained, "--wait=false")
    wait(lambda: drained_url not in worker_urls(router, url, key), 30, "the router removed the deleted pod")
    removed_s = time.monotonic() - t0
    print(f"router: unhealthy after {unhealthy_s:.2f} s (bound {ROUTER_DROP_BOUND_S} s), "
          f"removed {removed_s:.2f} s after the delete")
    assert unhealthy_s <= ROUTER_DROP_BOUND_S
    assert worker_urls(router, url, key) == expected - {drained_url}
    # The positive control of the 401s: with the admin key the same registration is accepted.
    code, text = http(router, "POST", f"{url}/workers", key, rogue)
    assert 200 <= code < 300, (code, text)
    wait(lambda: rogue["url"] in worker_urls(router, url, key), 30, "the registration made with the key")


def test_the_operator_creates_the_router_and_reports_the_endpoint(cluster: LocalCluster, namespace: str,
                                                                   operator: object) -> None:
    doc = yaml.safe_load((EXAMPLES / "valid" / "llama-dense.yaml").read_text())
    doc["spec"]["router"] = {"image": "host", "replicas": 2}
    name = doc["metadata"]["name"]
    apply(cluster, namespace, doc)

    def get(*args: str) -> dict | None:
        out = cluster.kubectl("-n", namespace, "get", *args, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    pdd = wait(lambda: (o := get("pdd", name)) and (o.get("status") or {}).get("endpoint") and o, 90,
               "status.endpoint written")
    assert pdd["status"]["endpoint"] == f"http://{router_name(name)}.{namespace}.svc:30000"
    table = cluster.kubectl("-n", namespace, "get", "pdd", name).stdout
    assert "ENDPOINT" in table.splitlines()[0] and pdd["status"]["endpoint"] in table, table
    uid = pdd["metadata"]["uid"]
    for kind in ("deployment", "service", "serviceaccount", "role", "rolebinding", "networkpolicy"):
        obj = wait(lambda k=kind: get(k, router_name(name)), 30, f"the router {kind}")
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid], kind
    assert get("secret", f"{router_name(name)}-keys") is not None
    role = get("role", router_name(name))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # The Deployment controller makes the router pods (kwok runs them: no kubelet in this test).
    wait(lambda: len((get("pods", "-l", f"pdfleet.io/router={name}") or {}).get("items", [])) == 2, 60,
         "2 router pods")


def _gated(pod: dict) -> dict:
    pod["spec"]["readinessGates"] = [{"conditionType": READINESS_GATE}]
    return pod


def _gate(cluster: LocalCluster, namespace: str, name: str, status: str) -> None:
    patch = {"status": {"conditions": [{"type": READINESS_GATE, "status": status}]}}
    cluster.kubectl("-n", namespace, "patch", "pod", name, "--subresource=status", "--type=strategic",
                    "-p", json.dumps(patch))


def typed_workers(client, url: str, key: str) -> dict[str, str]:
    """The router's worker set: url -> worker_type."""
    code, text = http(client, "GET", f"{url}/workers", key)
    return {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]} if code == 200 else {}


def test_a_drained_and_deleted_pods_worker_leaves_the_router_before_its_address_is_reused(
        cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    """0.3.2's discovery never removes a pod that went not-Ready before its deletion (every drained pod);
    in CI such a prefill's address went at once to a new decode, which the router then kept as a prefill.
    The router pod's sweeper (``front/stale_workers.py``) deletes the worker once its pod is gone."""
    objs = router_objects(namespace)
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] != worker_secret_name(NAME))
    key = base64.b64decode(secret["data"][CONTROL_PLANE_KEY]).decode().rsplit(":", 1)[1]
    stand_in = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stand-in-worker"},
                "data": {"worker.py": STAND_IN}}
    pods = [_gated(worker(Role.PREFILL, 0)), _gated(worker(Role.DECODE, 0))]
    apply(cluster, namespace, stand_in, *objs, *pods)
    names = [p["metadata"]["name"] for p in pods]
    ips = {n: started(kubelet, n).ip for n in names}
    for n in names:
        _gate(cluster, namespace, n, "True")
    router = started(kubelet, router_name(NAME) + "-")
    assert _spec().router is not None
    url = f"http://127.0.0.1:{upstream_port(_spec().router)}"
    prefill_url = f"http://{ips[names[0]]}:{HTTP_PORT}"
    wait(lambda: typed_workers(router, url, key) == {prefill_url: "prefill",
                                                     f"http://{ips[names[1]]}:{HTTP_PORT}": "decode"},
         120, "the router's workers = the two pods")
    # The drain: the pod goes not-Ready (its gate False), then it is deleted.
    _gate(cluster, namespace, names[0], "False")
    wait(lambda: not _ready(cluster, namespace, names[0]), 30, "the drained prefill not Ready")
    time.sleep(1.0)  # discovery has seen the not-Ready pod
    t0 = time.monotonic()
    cluster.kubectl("-n", namespace, "delete", "pod", names[0], "--wait=true", "--timeout=60s")
    gone_s = time.monotonic() - t0
    try:
        wait(lambda: prefill_url not in typed_workers(router, url, key), 30, "the deleted prefill's worker removed")
    except AssertionError as e:
        raise AssertionError(f"{e}: router log:\n{kubelet.log_of(router.name)[-3000:]}") from None
    removed_s = time.monotonic() - t0
    # A new decode: wherever its address comes from (kwok hands out a freed one first), it is a decode.
    new = _gated(worker(Role.DECODE, 1))
    apply(cluster, namespace, new)
    new_ip = started(kubelet, new["metadata"]["name"]).ip
    _gate(cluster, namespace, new["metadata"]["name"], "True")
    new_url = f"http://{new_ip}:{HTTP_PORT}"
    wait(lambda: typed_workers(router, url, key).get(new_url) == "decode", 60, "the new decode added as a decode")
    log = kubelet.log_of(router.name)
    print(f"router: the drained prefill's pod gone {gone_s:.1f} s after the delete, its worker removed at "
          f"{removed_s:.1f} s; the new decode at {new_ip} (the freed address: {new_ip == ips[names[0]]})")
    assert f"removed the router's prefill worker {prefill_url}" in log, log[-2000:]
    assert typed_workers(router, url, key) == {f"http://{ips[names[1]]}:{HTTP_PORT}": "decode", new_url: "decode"}


def _ready(cluster: LocalCluster, namespace: str, name: str) -> bool:
    pod = json.loads(cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
