"""Issue 39's acceptance on the local cluster: real runtimes, sglang-router behind the router pod's front, the
operator's webhook. One fleet (1 prefill, 2 decode, the router) for the module; each test is one finding's
sequence as the audit ran it, and fails on the tree before the issue (run once against main: see the note).

- a repeated request with the same ``bootstrap_room`` leaves the decode's pools as they were (held 0) and the
  pod answering;
- an unclaimed-room flood from a pod inside the namespace, without the worker key, gets 401s and costs the
  router's clients nothing;
- two slow senders leave a normal large review answered by the webhook in under 1 s;
- random ``model`` values add no router series;
- a tenant allowed to create pods cannot create or relabel one carrying the deployment's label.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.podsandbox import PodSandbox
from pdfleet_operator.admission.handlers import VALIDATE_WEBHOOK_ID
from pdfleet_runtime.testing.chat import ChatTraffic, chat_body, verify_chat_answer
from pdfleet_runtime.testing.scrape import scrape
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import CONCURRENCY, NAME, ROUTER_METRICS_PORT, Fleet, running_fleet
from tests.unit.admission.builders import Review, example

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    ns = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        with running_fleet(cluster, ns, tmp_path_factory.mktemp("pods")) as f:
            yield f
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def worker_key(fleet: Fleet) -> str | None:
    """The deployment's worker key (None where the tree has none: the test then calls as the audit did)."""
    out = fleet.cluster.kubectl("-n", fleet.ns, "get", "secret", f"{NAME}-worker-auth", "-o", "json", check=False)
    return base64.b64decode(json.loads(out.stdout)["data"]["key"]).decode() if out.returncode == 0 else None


def call(method: str, url: str, body: dict | None, key: str | None, timeout_s: float = 60) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def pods(fleet: Fleet, role: str) -> list[PodSandbox]:
    return sorted(fleet.runner.running(role).values(), key=lambda p: p.name)


def test_a_repeated_room_leaves_the_decode_pools_as_they_were(fleet: Fleet) -> None:
    """The audit: the same chat body with ``bootstrap_room`` R sent twice to a decode's port 8080, for 9 rooms,
    took the decode from held 0 to held 8 with nothing running, /readyz still 200, and later client requests
    through the router timed out."""
    key = worker_key(fleet)
    [prefill], decode = pods(fleet, "prefill")[:1], pods(fleet, "decode")[0]
    host, port = prefill.bootstrap.split(":")
    second: list[tuple[int, Any]] = []
    for i in range(9):
        body = {**chat_body(NAME, i), "bootstrap_host": host, "bootstrap_port": int(port),
                "bootstrap_room": random.getrandbits(63)}
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda b=body, o=out: o.update(p=call("POST", prefill.url + "/v1/chat/completions",
                                                                     b, key)))
        t.start()
        dcode, ans = call("POST", decode.url + "/v1/chat/completions", body, key)
        t.join(70)
        assert dcode == 200 and out["p"][0] == 200, (dcode, ans, out)
        assert verify_chat_answer(body, ans) is None
        second.append(call("POST", decode.url + "/v1/chat/completions", body, key, 30))
    print(f"repeated rooms: the second sends answered {[code for code, _ in second]}", flush=True)
    assert all(code == 409 and b["error"]["code"] == "room_conflict" for code, b in second), second[:2]

    def held() -> int:
        code, info = call("GET", decode.url + "/server_info", None, key, 10)
        assert code == 200, info
        return int(info["pools"]["held"])

    fleet.wait(lambda: held() == 0, 20, "the decode's pools back to held 0")
    with urllib.request.urlopen(decode.url + "/readyz", timeout=10) as r:
        assert json.loads(r.read())["ready"]
    answers = ChatTraffic(fleet.router_url(), NAME, concurrency=2, timeout_s=30)
    for i in range(10):  # the audit: 4 of 10 client requests through the router then timed out
        a = answers.once(i)
        assert a.ok, a.problem


FLOOD = r"""
import json, random, sys, urllib.error, urllib.request
from concurrent.futures import ThreadPoolExecutor
url = sys.argv[1]
def one(i):
    body = {"text": "flood", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
            "bootstrap_room": random.getrandbits(63)}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=40) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
with ThreadPoolExecutor(80) as pool:
    print(json.dumps(list(pool.map(one, range(80)))))
"""


def test_an_unclaimed_room_flood_without_the_key_gets_401s_and_costs_clients_nothing(fleet: Fleet) -> None:
    """The audit: 80 direct ``POST /generate`` with new rooms to a prefill's port 8080 left 16 rooms held for 30 s
    and a legitimate chat through the router got 502. The flood comes from a pod of the namespace (a decode
    pod's network namespace: its own address, not the router's) and sends no key."""
    traffic = fleet.traffic()
    traffic.wait_served(4)
    prefill, source = pods(fleet, "prefill")[0], pods(fleet, "decode")[0]
    t0 = time.monotonic()
    out = source.exec("python3", "-c", FLOOD, prefill.url + "/generate", timeout_s=120)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    codes = json.loads(out.stdout.strip().splitlines()[-1])
    m = scrape(prefill.url + "/metrics")
    held = sum(v for k, v in m.items() if k.startswith("pdfleet_rooms_held"))
    traffic.wait_served(8)
    traffic.stop()
    print(f"flood: 80 requests in {took:.2f}s, codes {sorted(set(codes))}, rooms held after {held}", flush=True)
    assert codes == [401] * 80, codes
    assert held <= CONCURRENCY  # the router's own traffic (4 in flight) holds rooms; the flood none
    traffic.assert_clean()  # zero client failures, router retries and failed transfers (expired rooms included)


def _slow_sender(url: str, ca: Path, uid: str, results: list[tuple[float, bytes]]) -> None:
    async def run() -> None:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        obj = example("llama-dense")
        obj["metadata"]["annotations"] = {"pad": "s" * (300 << 10)}
        body = Review(obj).uid(uid).body()
        ctx = ssl.create_default_context(cafile=str(ca))
        reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=host)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body[:-10])
        await writer.drain()
        t0, answer = time.monotonic(), b""
        try:
            for i in range(25):  # then a byte a second (the audit: still open after 25 s)
                try:
                    answer += await asyncio.wait_for(reader.read(65536), 1.0)
                    if answer and reader.at_eof():
                        break
                except TimeoutError:
                    writer.write(body[-10 + i % 10:][:1])
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
        results.append((time.monotonic() - t0, answer))

    asyncio.run(run())


def test_two_slow_senders_leave_a_normal_review_answered_in_under_a_second(fleet: Fleet,
                                                                           operator: OperatorProcess) -> None:
    """The audit: two connections each sending ~300 KiB of an AdmissionReview, then 1 byte/s; a normal ~400 KiB
    review 3 s later was answered after 5.02 s with ``allowed: false, code 429``."""
    hooks = json.loads(fleet.cluster.kubectl("get", "validatingwebhookconfiguration", "pdfleet-admission.pdfleet.io",
                                             "-o", "json").stdout)["webhooks"]
    url = next(h["clientConfig"]["url"] for h in hooks if h["clientConfig"]["url"].endswith(VALIDATE_WEBHOOK_ID))
    results: list[tuple[float, bytes]] = []
    slow = [threading.Thread(target=_slow_sender, args=(url, operator.ca_file, f"slow{i}", results)) for i in range(2)]
    for t in slow:
        t.start()
    time.sleep(3.0)  # as the audit: the normal review 3 s later
    obj = example("llama-dense")
    obj["metadata"]["annotations"] = {"pad": "n" * (400 << 10)}
    ctx = ssl.create_default_context(cafile=str(operator.ca_file))
    req = urllib.request.Request(url, data=Review(obj).uid("normal").body(), headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
        answer = json.loads(r.read())["response"]
    took = time.monotonic() - t0
    for t in slow:
        t.join(40)
    print(f"webhook: normal review answered in {took:.3f}s ({answer.get('status', {})}); slow senders "
          f"{[(round(w, 1), a[-120:]) for w, a in results]}", flush=True)
    assert answer["uid"] == "normal" and answer["allowed"] is True, answer
    assert took < 1.0, took
    assert len(results) == 2 and all(b'"code": 408' in a and w < 10 for w, a in results), results
    # The apiserver's own path: a server-side dry run of a large valid object is admitted.
    doc = {**example("llama-dense"), "metadata": {"name": "big", "namespace": fleet.ns,
                                                  "annotations": {"pad": "n" * (200 << 10)}}}
    out = fleet.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert out.returncode == 0, out.stderr


def _router_series(fleet: Fleet) -> set[str]:
    routers = [p for p in fleet.runner.pods.values() if p.name.startswith(f"{NAME}-router-") and p.started]
    assert routers
    return {k for p in routers for k in scrape(f"http://{p.ip}:{ROUTER_METRICS_PORT}/metrics")}


def test_random_model_values_add_no_router_series(fleet: Fleet) -> None:
    """The audit: 64 chats with random ``model`` values took sglang-router's /metrics from 474 to 735 series
    (``smg_router_request_errors_total{model="m-83-..."}``). The router pod's front refuses them first."""
    client = openai.OpenAI(base_url=fleet.router_url() + "/v1", api_key="unused", max_retries=0, timeout=30)
    body = chat_body(NAME, 0)
    assert verify_chat_answer(body, client.chat.completions.create(**body).model_dump()) is None
    before = _router_series(fleet)
    codes = []
    for i in range(64):
        try:
            client.chat.completions.create(**{**chat_body(NAME, i), "model": f"m-{i}-{random.getrandbits(40):x}"})
            codes.append(200)
        except openai.APIStatusError as e:
            codes.append(e.status_code)
    after = _router_series(fleet)
    # Series the router makes on its own meanwhile (pod discovery events) are no client's doing.
    grew = sorted(s for s in after - before if not s.startswith("smg_discovery_"))
    print(f"router: {len(before)} series before, {len(after)} after 64 random models; new: {grew[:3]}", flush=True)
    assert codes == [404] * 64, codes
    assert not grew, grew[:5]
    assert not [s for s in after if 'model="m-' in s]
    assert verify_chat_answer(body, client.chat.completions.create(**body).model_dump()) is None


def test_the_router_key_is_on_no_command_line(fleet: Fleet) -> None:
    """Low: the router's key was on its command line and in its environment (the kubelet expanded
    ``$(VAR)`` from a Secret-backed variable). What each router pod container was started with, as the kernel
    got it (its argv and environment; sglang-router's ``setproctitle`` later overwrites both in
    ``/proc/<pid>``, so they are read from the start here), holds neither key."""
    key = worker_key(fleet)
    cp = fleet.cluster.kubectl("-n", fleet.ns, "get", "secret", f"{NAME}-router-keys", "-o",
                               "jsonpath={.data.control-plane-api-keys}").stdout
    secret = base64.b64decode(cp).decode().rsplit(":", 1)[1]
    assert len(secret) >= 32
    routers = [p for p in fleet.runner.pods.values() if p.name.startswith(f"{NAME}-router-") and p.started]
    assert routers
    for pod in routers:
        for c in pod.containers:
            started = [*map(str, c.proc.args), *c.env.values()]
            for value in (secret, key):
                assert value is None or not any(value in a for a in started), (pod.name, c.name)


# A STAND-IN for a pod someone else made with the deployment's labels (no Secret mounted): it answers what
# the router registers a worker with and records every request it is sent (path, Authorization, body).
ROGUE = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self, body):
        raw = json.dumps(body).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw))); self.end_headers(); self.wfile.write(raw)
    def do_GET(self):
        print("GET", self.path, self.headers.get("Authorization"), flush=True)
        self._answer({"disaggregation_mode": "decode", "model_path": sys.argv[1], "served_model_name": sys.argv[1],
                      "is_generation": True})
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        print("POST", self.path, self.headers.get("Authorization"), body[:400].decode(errors="replace"), flush=True)
        self._answer({"error": "a stand-in"})
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def test_a_tenant_who_may_create_pods_cannot_put_the_deployment_label_on_one(fleet: Fleet) -> None:
    """Low, fixed: the pod-labels policy (``resources.pod_label_policy``) lets only holders of the ``own-pods`` verb
    on the PDDeployment (the operator, cluster admins) create a pod carrying its label or relabel one into it; a
    ServiceAccount allowed to create and patch pods in the namespace is denied both, and its unlabelled pod runs."""
    k = fleet.cluster.kubectl
    tenant = f"system:serviceaccount:{fleet.ns}:tenant"
    k("-n", fleet.ns, "create", "serviceaccount", "tenant")
    k("-n", fleet.ns, "create", "role", "tenant-pods", "--verb=create,get,list,patch,update,delete", "--resource=pods")
    k("-n", fleet.ns, "create", "rolebinding", "tenant-pods", "--role=tenant-pods", f"--serviceaccount={fleet.ns}:tenant")

    def pod(name: str, labels: dict[str, str]) -> str:
        return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                           "spec": {"containers": [{"name": "main", "image": "host", "command": ["sleep", "600"]}]}})

    labelled = k("-n", fleet.ns, "--as", tenant, "create", "-f", "-", check=False,
                 input=pod("tenant-rogue", {"pdfleet.io/deployment": NAME, "pdfleet.io/role": "decode"}))
    print(f"tenant's labelled pod: rc {labelled.returncode}: {labelled.stderr.strip()[:240]}", flush=True)
    assert labelled.returncode != 0 and "only the pdfleet operator may create a pod labelled" in labelled.stderr
    try:
        plain = k("-n", fleet.ns, "--as", tenant, "create", "-f", "-", check=False, input=pod("tenant-plain", {}))
        assert plain.returncode == 0, plain.stderr  # the policy asks only of pods that carry the label
        relabel = k("-n", fleet.ns, "--as", tenant, "label", "pod", "tenant-plain", f"pdfleet.io/deployment={NAME}",
                    check=False)
        assert relabel.returncode != 0 and "only the pdfleet operator" in relabel.stderr, relabel.stderr
        # Nor may it take the label off one of the operator's pods (the routers would keep it; the policy is
        # about the deployment's pods either way).
        victim = pods(fleet, "decode")[0].name
        unlabel = k("-n", fleet.ns, "--as", tenant, "label", "pod", victim, "pdfleet.io/role-", check=False)
        assert unlabel.returncode != 0 and "only the pdfleet operator" in unlabel.stderr, unlabel.stderr
        # An update that leaves the labels alone is not asked (annotations, as a tenant's tooling might add).
        note = k("-n", fleet.ns, "--as", tenant, "annotate", "pod", "tenant-plain", "note=ok", check=False)
        assert note.returncode == 0, note.stderr
    finally:
        k("-n", fleet.ns, "delete", "pod", "tenant-plain", "--wait=false", check=False)


def test_what_a_pod_that_only_carries_the_labels_can_and_cannot_see(fleet: Fleet) -> None:
    """What a labelled pod made by a holder of ``own-pods`` (a cluster admin here; a tenant is refused: above) but
    not by the operator can see, as docs/security.md says: the routers add it, so it receives prompts and the
    router's worker key; it gets no transfer state and no Secret."""
    compat = pods(fleet, "decode")[0].pod["metadata"]["labels"]["pdfleet.io/compat"]  # the routers select its generation
    rogue = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rogue-decode", "labels": {
        "pdfleet.io/deployment": NAME, "pdfleet.io/role": "decode", "pdfleet.io/compat": compat,
        "app.kubernetes.io/managed-by": "pdfleet-operator"}},
        "spec": {"automountServiceAccountToken": True, "containers": [{
            "name": "main", "image": "host", "command": ["python3", "-c", ROGUE, NAME],
            "ports": [{"name": "http", "containerPort": 8080}]}]}}
    fleet.cluster.kubectl("-n", fleet.ns, "apply", "-f", "-", input=json.dumps(rogue))
    try:
        pod = fleet.wait(lambda: next((p for p in list(fleet.runner.pods.values()) if p.name == "rogue-decode"
                                       and p.started), None), 60, "the rogue pod running")
        client = openai.OpenAI(base_url=fleet.router_url() + "/v1", api_key="unused", max_retries=0, timeout=15)
        prompt = f"a secret prompt {random.getrandbits(32):x}"

        def sent_to_rogue() -> bool:
            with contextlib.suppress(openai.OpenAIError):
                client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=4)
            return prompt in pod.log()

        fleet.wait(sent_to_rogue, 120, "the router sending a request to the pod that carries the labels")
        log = pod.log()
        key = worker_key(fleet)
        print(f"rogue pod saw: {[ln[:100] for ln in log.splitlines() if ln.startswith('POST')][:2]}", flush=True)
        assert prompt in log  # CAN: prompts in clear
        assert key is None or f"Bearer {key}" in log  # CAN: the router's worker key with each call
        # CANNOT: speak to the prefill's bootstrap (every message is signed with the deployment key it lacks).
        prefill = pods(fleet, "prefill")[0]
        out = pod.exec("python3", "-c", (
            "import urllib.request, urllib.error, sys\n"
            "r = urllib.request.Request(sys.argv[1], data=b'{\"type\": \"hello\"}', headers={'Content-Type': "
            "'application/json', 'Content-Length': '17'})\n"
            "try:\n    urllib.request.urlopen(r, timeout=10); print(200)\n"
            "except urllib.error.HTTPError as e:\n    print(e.code)\n"), f"http://{prefill.bootstrap}/v1/messages")
        assert out.stdout.strip() == "401", (out.stdout, out.stderr)
        # CANNOT: read the deployment's Secrets (its ServiceAccount, the namespace's default, may not).
        token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
        has_token = pod.exec("test", "-f", token).returncode == 0
        if has_token:
            code = pod.exec("sh", "-c", "curl -sS -o /dev/null -w '%{http_code}' --max-time 5 -k -H "
                            f"\"Authorization: Bearer $(cat {token})\" "
                            f"https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/{fleet.ns}"
                            f"/secrets/{NAME}-transfer-auth").stdout.strip()
            assert code == "403", code
        # CANNOT: find the transfer key on its filesystem (nothing of the deployment is mounted).
        assert pod.exec("test", "-e", "/var/run/pdfleet/auth/key").returncode != 0
    finally:
        fleet.cluster.kubectl("-n", fleet.ns, "delete", "pod", "rogue-decode", "--wait=false", check=False)


def test_the_router_replaces_client_bootstrap_fields_and_its_token_only_reads_pods(fleet: Fleet) -> None:
    """Issue 39 held (regression tests): the router replaces a client's ``bootstrap_host``, ``bootstrap_port``
    and ``bootstrap_room`` with its own; its ServiceAccount may only read pods."""
    body = {**chat_body(NAME, 3), "bootstrap_host": "10.99.99.99", "bootstrap_port": 1, "bootstrap_room": 5}
    code, ans = call("POST", fleet.router_url() + "/v1/chat/completions", body, None, 30)
    assert code == 200, ans
    assert ans["pdfleet"]["room"] != 5 and ans["pdfleet"]["prefill"] != "10.99.99.99:1", ans["pdfleet"]
    assert verify_chat_answer({**body, "bootstrap_room": ans["pdfleet"]["room"]}, ans) is None
    sa = f"system:serviceaccount:{fleet.ns}:{NAME}-router"
    allowed = {(verb, res): fleet.cluster.kubectl("-n", fleet.ns, "auth", "can-i", verb, res, f"--as={sa}",
                                                  check=False).stdout.strip()
               for verb, res in (("list", "pods"), ("watch", "pods"), ("get", "secrets"), ("create", "pods"),
                                 ("patch", "pods/status"), ("list", "pddeployments.pdfleet.io"))}
    assert allowed == {("list", "pods"): "yes", ("watch", "pods"): "yes", ("get", "secrets"): "no",
                       ("create", "pods"): "no", ("patch", "pods/status"): "no",
                       ("list", "pddeployments.pdfleet.io"): "no"}, allowed
