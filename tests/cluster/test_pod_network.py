"""The harness's kubelet and container runtime (devcluster.kubelet, podsandbox) on the real control plane.

Each pod runs in its own network namespace at the IP kwok gave it; from inside a pod, another pod's
IP, a headless Service's name (CoreDNS) and a ClusterIP Service (kube-proxy, nftables) reach it;
preStop hooks (exec and httpGet) run before SIGTERM; a pod's own ServiceAccount token is all it has,
so the apiserver refuses what its Role does not grant. And the positive control: from the test
process and from a pod, an address outside the cluster is unreachable, or the run is not inside.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster, podsandbox, sandbox
from pdfleet_devcluster.kubelet import Kubelet, wait
from pdfleet_devcluster.toolchain import PINS
from pdfleet_operator.resources.rbac import runtime_role, runtime_role_binding, runtime_service_account
from tests.helpers import IDENTITY

pytestmark = pytest.mark.cluster

LABEL = {"pdfleet.io/test": "net"}
PY = sys.executable


def unreachable_from_here(address: str = sandbox.CONTROL_ADDRESS) -> str:
    """The positive control, safe outside: a route to ``address`` means outside, and then nothing is sent."""
    if sandbox.routed(address):
        raise AssertionError(f"a route to {address} exists: this run is NOT inside the cluster's private namespace "
                             "(nothing was sent)")
    with socket.socket() as s:
        s.settimeout(5)
        err = s.connect_ex((address, 80))
    assert err == errno.ENETUNREACH, f"connect to {address}: {errno.errorcode.get(err, err)}, not ENETUNREACH"
    return "Network is unreachable"


def test_the_test_process_cannot_leave() -> None:
    assert unreachable_from_here() == "Network is unreachable"
    assert sandbox.inside()


def pod(name: str, containers: list[dict], **spec: object) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {**LABEL, "app": name}},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 20, **spec}}


def server(port: int = 8080) -> dict:
    return {"name": "web", "image": "host", "command": [PY, "-m", "http.server", "$(PORT)", "--bind", "0.0.0.0"],
            "env": [{"name": "PORT", "value": str(port)}], "ports": [{"name": "http", "containerPort": port}]}


def idle(name: str = "main", **more: object) -> dict:
    return {"name": name, "image": "host", "command": ["sleep", "3600"], **more}


@pytest.fixture
def kubelet(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    k = cluster.kubelet(namespace, tmp_path / "pods", selector="pdfleet.io/test=net")
    k.start()
    try:
        yield k
    finally:
        k.shutdown(grace_s=5)


def apply(cluster: LocalCluster, namespace: str, *objs: dict) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objs))


def started(kubelet: Kubelet, name: str, timeout: float = 60):  # -> PodSandbox
    return wait(lambda: next((p for p in list(kubelet.pods.values()) if p.name == name and p.started), None),
                timeout, f"pod {name} started by the kubelet")


def curl(client, url: str) -> str:  # client: PodSandbox
    out = client.exec("curl", "-sS", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", url)
    return out.stdout.strip() or out.stderr.strip()


def test_pods_reach_each_other_by_ip_headless_name_and_cluster_ip(cluster: LocalCluster, namespace: str,
                                                                  kubelet: Kubelet) -> None:
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": {"app": "srv"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-headless"},
                "spec": {"clusterIP": "None", "selector": {"app": "srv"}, "ports": [{"port": 8080}]}}
    apply(cluster, namespace, svc, headless, pod("srv", [server()]), pod("client", [idle()]))
    srv, client = started(kubelet, "srv"), started(kubelet, "client")
    pods = ipaddress.ip_network(cluster.options.ranges.pod_cidr)
    assert srv.ip != client.ip and all(ipaddress.ip_address(p.ip) in pods for p in (srv, client))
    # The server pod's own loopback is its own: the client's 127.0.0.1:8080 has nothing.
    wait(lambda: curl(client, f"http://{srv.ip}:8080/") == "200", 30, "the server pod's IP from the client pod")
    assert curl(client, "http://127.0.0.1:8080/") != "200"
    # kwok marks the pod Ready; the endpoint controller publishes it; CoreDNS and kube-proxy follow.
    wait(lambda: curl(client, "http://web-headless:8080/") == "200", 60, "the headless Service's name")
    got = client.exec("getent", "ahostsv4", f"web-headless.{namespace}.svc.cluster.local").stdout.split()
    assert got and got[0] == srv.ip, got
    wait(lambda: curl(client, "http://web/") == "200", 60, "the ClusterIP Service by name")
    cluster_ip = json.loads(cluster.kubectl("-n", namespace, "get", "svc", "web", "-o", "json").stdout)["spec"]["clusterIP"]
    assert curl(client, f"http://{cluster_ip}:80/") == "200"
    # The apiserver through its Service (it advertises the bridge address), TLS verified with the pod's ca.crt.
    ca = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    out = client.exec("curl", "-sS", "--max-time", "5", "--cacert", ca, "https://kubernetes.default.svc/version")
    assert json.loads(out.stdout or "{}").get("gitVersion") == PINS.kubernetes, out
    # And nothing leaves from a pod either (its default route ends at the node, which routes nowhere).
    probe = client.exec(PY, "-c", f"import socket; s = socket.socket(); print(s.connect_ex(('{sandbox.CONTROL_ADDRESS}', 80)))")
    assert probe.stdout.strip() == str(errno.ENETUNREACH), probe


HOOKED = textwrap.dedent("""
    import http.server, os, signal, sys, threading, time
    events = os.path.join("/run/data", "events")
    def log(line):  # stamped with the host's monotonic clock, which the test's and the kubelet's share
        with open(events, "a") as f:
            f.write(f"{line} @{time.monotonic():.1f}\\n")
    name = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *_: (log(name + " SIGTERM"), os._exit(0)))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            log(name + " httpGet " + self.path)
            self.send_response(200)
            self.end_headers()
    if len(sys.argv) > 2:
        srv = http.server.HTTPServer(("0.0.0.0", int(sys.argv[2])), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    log(name + " started")
    threading.Event().wait()
""")


def _hooked_pod(cluster: LocalCluster, namespace: str, kubelet: Kubelet, name: str, containers: list[dict],
                *, grace_s: int) -> tuple[podsandbox.PodSandbox, Path]:
    """A pod of ``containers`` running ``HOOKED`` (mounted from a ConfigMap) that log to a shared emptyDir, started
    by the harness's kubelet with both containers up: its sandbox and the events file."""
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hooks"}, "data": {"hooked.py": HOOKED}}
    volumes = [{"name": "hooks", "configMap": {"name": "hooks"}}, {"name": "data", "emptyDir": {}}]
    apply(cluster, namespace, cm, pod(name, containers, volumes=volumes, terminationGracePeriodSeconds=grace_s))
    sb = started(kubelet, name)
    events = sb.workdir / "volumes" / "data" / "events"
    wait(lambda: events.exists() and events.read_text().count("started") == 2, 30, "both containers up")
    return sb, events


def test_pre_stop_hooks_run_before_sigterm(cluster: LocalCluster, namespace: str, kubelet: Kubelet,
                                           tmp_path: Path) -> None:
    script = {"name": "hooks", "mountPath": "/run/hooks", "readOnly": True}
    data = {"name": "data", "mountPath": "/run/data"}
    containers = [
        {"name": "by-exec", "image": "host", "command": [PY, "/run/hooks/hooked.py", "exec"],
         "volumeMounts": [script, data],
         "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo exec preStop >> /run/data/events"]}}}},
        {"name": "by-http", "image": "host", "command": [PY, "/run/hooks/hooked.py", "http", "9090"],
         "ports": [{"name": "hook", "containerPort": 9090}], "volumeMounts": [script, data],
         "lifecycle": {"preStop": {"httpGet": {"path": "/pre-stop", "port": "hook"}}}},
    ]
    # A long grace period: the hooks end in well under a second, and terminate goes on as soon as they do; the
    # grace period only bounds how long a host stalled under CI's load may take to run them (seen: over 20 s).
    sb, events = _hooked_pod(cluster, namespace, kubelet, "hooked", containers, grace_s=90)
    deleted = time.monotonic() - sb.made_at
    cluster.kubectl("-n", namespace, "delete", "pod", "hooked", "--wait=false")
    try:
        wait(lambda: events.read_text().count("SIGTERM") == 2, 150, "both containers got SIGTERM")
    except AssertionError as e:  # the containers' lines carry @<monotonic>; the kubelet's, seconds since made_at
        raise AssertionError(f"{e}: {events.read_text()!r}, sandbox made at @{sb.made_at:.1f}, deleted at "
                             f"{deleted:.1f}s, kubelet: {sb.events}, {kubelet.errors[-3:]}") from None
    lines = [line.split(" @")[0] for line in events.read_text().splitlines()]
    assert lines.index("exec preStop") < lines.index("exec SIGTERM"), lines
    assert lines.index("http httpGet /pre-stop") < lines.index("http SIGTERM"), lines


def test_a_sleeping_pre_stop_keeps_its_container_up_while_the_others_get_sigterm(
        cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    """Each container stops on its own, as the kubelet stops them: one without a hook gets SIGTERM at once,
    one whose preStop sleeps gets it after the sleep (a router container outliving its front's drain). kwok
    removes a pod with grace 0; a pod with a sleeping hook stays until its deletionTimestamp, so its containers
    keep their grace period."""
    script = {"name": "hooks", "mountPath": "/run/hooks", "readOnly": True}
    data = {"name": "data", "mountPath": "/run/data"}
    containers = [
        {"name": "bare", "image": "host", "command": [PY, "/run/hooks/hooked.py", "bare"], "volumeMounts": [script, data]},
        {"name": "sleeper", "image": "host", "command": [PY, "/run/hooks/hooked.py", "sleeper"],
         "volumeMounts": [script, data], "lifecycle": {"preStop": {"sleep": {"seconds": 3}}}},
    ]
    sb, events = _hooked_pod(cluster, namespace, kubelet, "sleepy", containers, grace_s=30)
    t0 = time.monotonic()
    cluster.kubectl("-n", namespace, "delete", "pod", "sleepy", "--wait=false")
    wait(lambda: "bare SIGTERM" in events.read_text(), 30, "the container without a hook got SIGTERM")
    bare_s = time.monotonic() - t0
    wait(lambda: "sleeper SIGTERM" in events.read_text(), 60, "the sleeping container got SIGTERM")
    sleeper_s = time.monotonic() - t0
    print(f"SIGTERM: bare {bare_s:.1f}s, sleeper {sleeper_s:.1f}s after the delete; kubelet: {sb.events}")
    assert bare_s < 3 <= sleeper_s, (bare_s, sleeper_s, sb.events)


def test_a_pod_has_only_its_own_token_and_its_role(cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    """The runtime's ServiceAccount and Role (over the deployment's pods by name) as the operator writes them;
    the pod's token is minted for it."""
    rbac = [runtime_service_account("net", namespace), runtime_role("net", namespace, ["whoami"]),
            runtime_role_binding("net", namespace)]
    sa = rbac[0]["metadata"]["name"]
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    apply(cluster, namespace, *rbac, pod("whoami", [idle(env=env)], serviceAccountName=sa,
                                         automountServiceAccountToken=True))
    sb = started(kubelet, "whoami")
    assert "KUBECONFIG" not in sb.containers[0].env
    out = sb.exec(PY, "-c", IDENTITY)
    assert json.loads(out.stdout or "{}") == {"get own pod": 200, "list secrets": 403}, out.stderr[-2000:]
    token = sb.exec("cat", "/var/run/secrets/kubernetes.io/serviceaccount/token").stdout
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
    got = json.loads(cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review)).stdout)["status"]
    assert got["user"]["username"] == f"system:serviceaccount:{namespace}:{sa}", got
    assert got["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["whoami"], got


def test_a_stopped_pod_leaves_nothing_on_the_bridge_that_answers_for_its_ip(cluster: LocalCluster, namespace: str,
                                                                           kubelet: Kubelet) -> None:
    """A process that left the container's process group keeps the pod's network namespace alive after
    ``ip netns delete``; its eth0 would go on answering for the IP kwok hands to the next pod. The
    kubelet kills it and deletes the veth pair before it frees the IP."""
    straggler = {"name": "main", "image": "host",
                 "command": ["sh", "-c", "setsid sleep 3600 </dev/null >/dev/null 2>&1 & exec sleep 3600"]}
    apply(cluster, namespace, pod("leaky", [straggler], terminationGracePeriodSeconds=1))
    sb = started(kubelet, "leaky")
    ns_pids = wait(lambda: (p := podsandbox._netns_pids(sb.netns)) and len(p) >= 2 and p, 30, "both sleeps up")
    veth = f"v{sb.uid[:8]}"
    assert podsandbox._link_exists(veth)
    cluster.kubectl("-n", namespace, "delete", "pod", "leaky", "--wait=false")
    wait(lambda: not sb.network_up, 60, "the pod's network taken down")
    assert not podsandbox._link_exists(veth), sb.events
    assert sb.ip not in podsandbox.IPS_IN_USE
    assert not [pid for pid in ns_pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"], sb.events
    assert any("SIGKILL straggler" in e for e in sb.events), sb.events


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


AUTH_PROBE = textwrap.dedent("""
    import os, ssl, time, urllib.error, urllib.request
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
    url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}/api/v1/namespaces/{open(f'{sa}/namespace').read()}/pods/again"
    while True:  # its own pod, which the namespace's default ServiceAccount may not read: 403 once authenticated
        req = urllib.request.Request(url, headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
        try:
            code = urllib.request.urlopen(req, context=ctx, timeout=5).status
        except urllib.error.HTTPError as e:
            code = e.code
        print("auth", code, os.environ["POD_UID"], flush=True)
        time.sleep(0.2)
""")


def _review(cluster: LocalCluster, token: str):  # -> V1TokenReviewStatus
    from kubernetes.client import AuthenticationV1Api

    return AuthenticationV1Api(cluster.api_client()).create_token_review({"spec": {"token": token}}).status


def test_a_pod_recreated_under_an_earlier_pods_name_gets_its_own_token_and_directory(
        cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    """Issue 38's 401s: the new pod's token is bound to the new pod and accepted from its first request on
    (the kubelet has the API review it before the containers start); the earlier pod's token is refused once
    that pod is gone; and the two pods share no directory (log, emptyDir), as a kubelet keeps them by UID."""
    spec = pod("again", [{"name": "main", "image": "host", "command": [PY, "-c", AUTH_PROBE],
                          "env": [{"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
                          "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]}],
               volumes=[{"name": "scratch", "emptyDir": {}}], terminationGracePeriodSeconds=2)
    apply(cluster, namespace, spec)
    first = started(kubelet, "again")
    wait(lambda: first.log().count("auth ") >= 3, 60, "the first pod's requests")
    assert first.exec("touch", "/tmp/left-by-the-first").returncode == 0
    (first_token,) = [p.read_text() for p in (first.workdir / "volumes").glob("kube-api-access-*/token")]
    cluster.kubectl("-n", namespace, "delete", "pod", "again", "--wait=false")
    wait(lambda: cluster.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(spec), check=False).returncode == 0,
         60, "the name free again")
    second = wait(lambda: next((p for p in list(kubelet.pods.values()) if p.name == "again" and p.uid != first.uid
                                and p.started), None), 60, "the second pod started")
    wait(lambda: second.log().count("auth ") >= 5, 60, "the second pod's requests")
    lines = [ln.split() for ln in second.log().splitlines() if ln.startswith("auth ")]
    assert {code for _, code, _ in lines} == {"403"}, lines  # authenticated (as the namespace's default
    # ServiceAccount, which may not read pods) from its first request on, never 401
    assert {uid for _, _, uid in lines} == {second.uid}, lines  # its log is its own (the first's is elsewhere)
    assert second.workdir != first.workdir
    assert "left-by-the-first" not in second.exec("ls", "-a", "/tmp").stdout  # its emptyDir is its own
    (second_token,) = [p.read_text() for p in (second.workdir / "volumes").glob("kube-api-access-*/token")]
    st = _review(cluster, second_token)
    assert st.authenticated and st.user.extra["authentication.kubernetes.io/pod-uid"] == [second.uid], st
    # Bound to the first pod's UID, while the name holds a pod of another UID now: refused, once the apiserver's
    # cache of recent successes (10 s) let go of it.
    wait(lambda: not _review(cluster, first_token).authenticated, 30, "the first pod's token refused")


def _ready(cluster: LocalCluster, namespace: str, name: str) -> tuple[str, str]:
    """The pod's (ContainersReady, Ready) statuses."""
    conds = json.loads(cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)["status"]["conditions"]
    by = {c["type"]: c["status"] for c in conds}
    return by.get("ContainersReady", "?"), by.get("Ready", "?")


def test_a_pod_without_readiness_gates_is_ready_only_while_its_readiness_probe_passes(
        cluster: LocalCluster, namespace: str, kubelet: Kubelet) -> None:
    """The kubelet runs readiness probes of pods without gates (a router pod's /readiness): not Ready until the
    probe passes, Ready while it passes, not Ready after ``failureThreshold`` failures (kwok alone made it Ready
    at once)."""
    web = {**server(), "command": [PY, "-m", "http.server", "8080", "--bind", "0.0.0.0", "--directory", "/www"],
           "volumeMounts": [{"name": "www", "mountPath": "/www"}],
           "readinessProbe": {"httpGet": {"path": "/ok", "port": "http"}, "periodSeconds": 1, "failureThreshold": 2}}
    apply(cluster, namespace, pod("probed", [web], volumes=[{"name": "www", "emptyDir": {}}]))
    srv = started(kubelet, "probed")
    wait(lambda: curl(srv, "http://127.0.0.1:8080/") == "200", 30, "the server answers")
    time.sleep(3)  # several failed probes (/ok is 404)
    assert _ready(cluster, namespace, "probed") == ("False", "False")
    srv.exec("touch", "/www/ok")
    wait(lambda: _ready(cluster, namespace, "probed") == ("True", "True"), 15, "Ready once the probe passes")
    srv.exec("rm", "/www/ok")
    wait(lambda: _ready(cluster, namespace, "probed") == ("False", "False"), 15, "not Ready after the probe fails")
