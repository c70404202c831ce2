"""Issue 39 (hardening, third round) against real ``serve`` processes, sglang-router 0.3.2 and the router pod's front.

A prefill and a decode pod on loopback with the deployment's worker key (``workerKeyPath``), and, for the
router's findings, sglang-router started by ``pdfleet-runtime router-launch`` (keys from files) behind
``pdfleet-runtime router-front``, as the router pod runs them. Each test names the finding it covers.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdfleet_runtime.testing.local import REPO
from pdfleet_runtime.testing.worker_client import chat_body, verify_chat_answer
from tests.server.harness import Pod, config, free_offset, http, metric

pytestmark = pytest.mark.slow

KEY = "worker-key-" + "k" * 40
MODEL = "hardening-model"
FAST = ("--retry-period", "0.3", "--canary-timeout", "5", "--canary-tokens", "64", "--canary-period", "1",
        "--floor-gbps", "0")  # readiness here means no failed canary: a loaded host's slow one is no fault of these


def cfg(role: str) -> Any:
    return config(role, requests=4, tokens=512).model_copy(update={"served_model_name": MODEL})


class Pair:
    def __init__(self, tmp: Path, *, decode_env: dict[str, str] | None = None) -> None:
        self.prefill = Pod(tmp, "pre", cfg("prefill"), offset=free_offset(), worker_key=KEY)
        self.decode = Pod(tmp, "dec", cfg("decode"), args=FAST, worker_key=KEY,
                          env=decode_env or {"PDFLEET_PREFILL_ADDRESSES": self.prefill.bootstrap})
        self.prefill.start()
        self.decode.start()
        self.decode.wait_ready(True, 90)

    def body(self, room: int | None = None) -> dict[str, Any]:
        host, port = self.prefill.bootstrap.split(":")
        return {**chat_body(MODEL, 0), "bootstrap_host": host, "bootstrap_port": int(port),
                "bootstrap_room": room if room is not None else random.getrandbits(63)}

    def send(self, body: dict[str, Any]) -> tuple[tuple[int, Any], tuple[int, Any]]:
        """The router's step: the body to the prefill and the decode at once, with the key."""
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(p=self.prefill.post("/v1/chat/completions", body, 60)))
        t.start()
        dec = self.decode.post("/v1/chat/completions", body, 60)
        t.join(70)
        return out["p"], dec

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.stop()


def pools(pod: Pod) -> dict[str, Any]:
    code, info = pod.get("/server_info")
    assert code == 200, info
    return info["pools"]


def test_a_room_sent_twice_is_refused_and_leaves_the_decode_pools_as_they_were(pair: Pair) -> None:
    """High: the same body with the same bootstrap_room, twice to the decode (issue: 9 rooms took every slot,
    held 8 with nothing running, /readyz still 200). Now 409 before anything is allocated, held back to 0."""
    before = pools(pair.decode)
    assert before["held"] == 0
    for _ in range(9):
        body = pair.body()
        (pcode, _), (dcode, ans) = pair.send(body)
        assert (pcode, dcode) == (200, 200), ans
        assert verify_chat_answer(body, ans) is None
        code, again = pair.decode.post("/v1/chat/completions", body, 30)
        assert code == 409 and again["error"]["code"] == "room_conflict", again
    # The last answer's items are released right after it was sent (under load, a moment later): a leak is items
    # that stay held, so the pools are read until they settle, for at most 10 s.
    deadline = time.monotonic() + 10
    while (after := pools(pair.decode))["held"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["held"] == 0 and after["free"] == before["free"], after
    assert after["heldBy"] == {"running": 0, "fencing": 0, "orphaned": 0}
    ready = pair.decode.readyz()
    assert ready["ready"] and ready["failedInRow"] == 0, ready
    m = pair.decode.metrics()
    assert metric(m, "pdfleet_pool_requests_held", reason="orphaned") == 0
    assert metric(m, "pdfleet_transfers_total", role="decode", kind="request", outcome="failed") == 0
    (pcode, _), (dcode, ans) = pair.send(pair.body())  # still serving
    assert (pcode, dcode) == (200, 200), ans


def test_worker_routes_want_the_key_probes_and_metrics_do_not(pair: Pair) -> None:
    """Medium and Low: any caller could hold rooms, and /get_server_info, /v1/models answered without the key."""
    for pod in (pair.prefill, pair.decode):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/generate"), ("POST", "/v1/completions"),
                             ("GET", "/get_server_info"), ("GET", "/server_info"), ("GET", "/v1/models"),
                             ("GET", "/model_info"), ("POST", "/v1/synthetic")):
            for key in (None, "wrong-key-" + "x" * 30):
                code, body = http(method, pod.url + path, pair.body() if method == "POST" else None, 10, key=key)
                assert code == 401, (pod.name, path, code, body)
                assert body["error"]["code"] == "invalid_api_key"
            code, _ = http(method, pod.url + path, None if method == "GET" else {}, 10, key=KEY)
            assert code != 401, (pod.name, path)
        for path in ("/healthz", "/readyz", "/metrics", "/health"):
            # The kubelet, Prometheus, and sglang-router's first probe of a worker (sent without its key): open.
            with urllib.request.urlopen(pod.url + path, timeout=10) as r:
                assert r.status == 200
    code, rooms = pair.prefill.get("/server_info")
    assert code == 200 and rooms["internal_states"][0]["num_queue_reqs"] == 0  # nothing held by the 401s
    # Held (a regression test): a body over 1 MiB is refused 413, with the key too.
    big = {**pair.body(), "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    code, _ = http("POST", pair.decode.url + "/v1/chat/completions", big, 10, key=KEY)
    assert code == 413


def test_malformed_bodies_are_400_and_the_decode_dials_only_discovered_prefill_pods(pair: Pair) -> None:
    """Lows: deeply nested JSON and a lone surrogate gave 500; a body's bootstrap_host made the decode send
    signed hellos to any address."""
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b', "bootstrap_room": 1}'
    lone = b'{"messages": [{"role": "user", "content": "\\ud800"}], "bootstrap_room": 2}'
    for pod in (pair.prefill, pair.decode):
        for raw in (deep, lone):
            req = urllib.request.Request(pod.url + "/v1/chat/completions", data=raw, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError("accepted")
            except urllib.error.HTTPError as e:
                assert e.code == 400, (pod.name, e.code, e.read()[:200])
    for raw in (deep, b'{"tokens": 8, "requestId": "\\ud800"}'):
        req = urllib.request.Request(pair.decode.url + "/v1/synthetic", data=raw, headers={
            "Authorization": f"Bearer {KEY}"})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 400, e.read()[:200]
    # A listener the decode's discovery does not name: the request is refused and nothing connects to it.
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.settimeout(3.0)
        body = {**pair.body(), "bootstrap_host": "127.0.0.1", "bootstrap_port": trap.getsockname()[1]}
        code, ans = pair.decode.post("/v1/chat/completions", body, 30)
        assert code == 400 and ans["error"]["param"] == "bootstrap_host", ans
        with pytest.raises(TimeoutError):
            trap.accept()
    assert pair.decode.readyz()["ready"]


def test_tiny_timeouts_do_not_flip_readiness(pair: Pair) -> None:
    """Low: /v1/synthetic with timeoutS 0.001 flipped /readyz to TransfersFailing (4 of 73 samples)."""
    flips = 0
    for i in range(30):
        code, res = pair.decode.synthetic(tokens=16, timeout_s=0.001, requestId=f"tiny-{i}")
        assert code in (200, 502, 503), res
        body = pair.decode.readyz()
        flips += not body["ready"]
    assert flips == 0 and pair.decode.readyz()["failedInRow"] == 0


def test_port_8080_closes_half_sent_connections_and_slow_bodies(pair: Pair) -> None:
    """Low: 1,500 half-sent connections were held 30 s and a slow body 24 s on port 8080."""
    port = int(pair.prefill.url.rsplit(":", 1)[1])
    half = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(50)]
    for s in half:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    slow = socket.create_connection(("127.0.0.1", port), timeout=20)
    slow.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    t0 = time.monotonic()
    assert all(closed(s) for s in half)  # cut at the idle deadline (10 s), not held
    answer = slow.recv(4096)
    waited = time.monotonic() - t0
    assert b" 408 " in answer.split(b"\r\n", 1)[0], answer[:200]
    assert waited < 15, waited
    for s in (*half, slow):
        s.close()
    assert pair.decode.readyz()["ready"]


def closed(s: socket.socket) -> bool:
    """The server closed ``s`` (EOF or reset) before the socket's timeout."""
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _router_metric_series(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {line.split(" ")[0] for line in r.read().decode().splitlines() if line and not line.startswith("#")}


def test_the_router_pod_keys_from_files_and_its_front(pair: Pair, tmp_path: Path) -> None:
    """Medium and Lows on the router: random ``model`` values grew its metrics; its key was on its command line;
    its port held half-sent connections. The router pod's two processes, as the operator renders them."""
    key_file, cp_file = tmp_path / "worker-key", tmp_path / "cp-keys"
    key_file.write_text(KEY)
    cp_file.write_text("pdfleet:pdfleet-operator:admin:" + "c" * 40)
    off = free_offset()  # its HTTP, admin and group ports are free (below the ephemeral range)
    router_port, metrics_port, front_port = 8080 + off, 8081 + off, 8997 + off
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime"), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    boot_port = pair.prefill.bootstrap.split(":")[1]
    router = subprocess.Popen(
        [sys.executable, "-m", "pdfleet_runtime", "router-launch", "--api-key-file", str(key_file),
         "--control-plane-keys-file", str(cp_file), "--", "--pd-disaggregation", "--host", "127.0.0.1",
         "--port", str(router_port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
         "--prefill", pair.prefill.url, boot_port, "--decode", pair.decode.url, "--prefill-policy", "round_robin",
         "--decode-policy", "round_robin", "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1"],
        env=env, stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    front = subprocess.Popen(
        [sys.executable, "-m", "pdfleet_runtime", "router-front", "--listen", f"127.0.0.1:{front_port}",
         "--router", "sglang", "--upstream", f"http://127.0.0.1:{router_port}", "--served-model", MODEL,
         "--api-key-file", str(key_file)],
        env=env, stdout=(tmp_path / "front.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        cmdline = Path(f"/proc/{router.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and b"c" * 40 not in cmdline  # keys never on the command line
        assert KEY.encode() not in Path(f"/proc/{router.pid}/environ").read_bytes()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{front_port}/v1", api_key="anything", max_retries=0,
                               timeout=30)
        deadline, last = time.monotonic() + 90, ""
        while time.monotonic() < deadline:  # the router registers its workers (their /server_info wants the key)
            try:
                ans = client.chat.completions.create(**chat_body(MODEL, 1)).model_dump()
                if verify_chat_answer(chat_body(MODEL, 1), ans) is None:
                    break
            except openai.OpenAIError as e:
                last = repr(e)
            time.sleep(1)
        else:
            raise AssertionError(f"no chat through the front: {last}\n{(tmp_path / 'router.log').read_text()[-3000:]}")
        for i in range(8):  # clients need no key: the front adds it
            body = chat_body(MODEL, i)
            assert verify_chat_answer(body, client.chat.completions.create(**body).model_dump()) is None
        before = _router_metric_series(metrics_port)
        names = [f"m-{i}-{random.getrandbits(32)}" for i in range(64)]
        for i, name in enumerate(names):
            with pytest.raises(openai.NotFoundError) as e:
                client.chat.completions.create(**{**chat_body(MODEL, i), "model": name})
            assert e.value.code == "model_not_found"
        after = _router_metric_series(metrics_port)
        # No client-chosen value reached the router: no series carries one (series of the router's own, such as
        # its first health checks' results, may appear meanwhile).
        assert not [s for s in after - before if any(n in s for n in names)], sorted(after - before)[:5]
        assert not [s for s in after if 'model="m-' in s]
        # The router itself, past the front, wants the key from its clients: its port is on loopback only.
        code, _ = http("POST", f"http://127.0.0.1:{router_port}/v1/chat/completions", chat_body(MODEL, 0), 10)
        assert code == 401
        # Only the serving routes pass the front: the router's control endpoints stay on its loopback.
        for path in ("/workers", "/flush_cache", "/list_workers"):
            code, _ = http("GET", f"http://127.0.0.1:{front_port}{path}", None, 10)
            assert code == 404, path
        # Half-sent connections and slow bodies are cut at the front's deadlines (10 s).
        half = [socket.create_connection(("127.0.0.1", front_port), timeout=20) for _ in range(20)]
        for s in half:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        slow = socket.create_connection(("127.0.0.1", front_port), timeout=20)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{")
        t0 = time.monotonic()
        assert all(closed(s) for s in half)
        assert b" 408 " in slow.recv(4096).split(b"\r\n", 1)[0]
        assert time.monotonic() - t0 < 15
        for s in (*half, slow):
            s.close()
        body = chat_body(MODEL, 99)  # the front still serves
        assert verify_chat_answer(body, client.chat.completions.create(**body).model_dump()) is None
    finally:
        for p in (front, router):
            p.terminate()
        for p in (front, router):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_the_canary_gauge_of_a_prefill_pod_that_went_goes_too(tmp_path: Path) -> None:
    """Low: ``pdfleet_canary_throughput_gbps`` kept a series for every prefill pod ever canaried."""
    prefill = Pod(tmp_path, "pre", cfg("prefill"), offset=free_offset(), worker_key=KEY).start()
    addresses = tmp_path / "prefills.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there: its canary fails, a gauge of 0
    addresses.write_text(json.dumps([prefill.bootstrap, gone]))
    decode = Pod(tmp_path, "dec", cfg("decode"), args=FAST, worker_key=KEY,
                 env={"PDFLEET_PREFILL_ADDRESSES_FILE": str(addresses)}).start()
    try:
        decode.wait_ready(True, 90)
        series = lambda: {k for k in decode.metrics() if k.startswith("pdfleet_canary_throughput_gbps{")}  # noqa: E731
        deadline = time.monotonic() + 30
        while len(series()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert series() == {f"pdfleet_canary_throughput_gbps{{peer={p}}}" for p in (prefill.bootstrap, gone)}
        # each pair's verdict: the live prefill's passed, the gone one's failed, and the decode stays ready (one
        # failing pair is reported, not acted on)
        ok = {k: v for k, v in decode.metrics().items() if k.startswith("pdfleet_canary_peer_ok{")}
        assert ok == {f"pdfleet_canary_peer_ok{{peer={prefill.bootstrap}}}": 1.0,
                      f"pdfleet_canary_peer_ok{{peer={gone}}}": 0.0}, ok
        assert decode.readyz()["ready"], decode.readyz()
        addresses.write_text(json.dumps([prefill.bootstrap]))  # the Service no longer names it
        deadline = time.monotonic() + 30
        while len(series()) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert series() == {f"pdfleet_canary_throughput_gbps{{peer={prefill.bootstrap}}}"}
        assert {k for k in decode.metrics() if k.startswith("pdfleet_canary_peer_ok{")} == {
            f"pdfleet_canary_peer_ok{{peer={prefill.bootstrap}}}"}
    finally:
        decode.stop()
        prefill.stop()
