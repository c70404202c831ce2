"""vllm-router 0.1.17 behind pdfleet's front, both run from the router pod pdfleet renders.

The router is the ``vllm-router`` script of the vLLM check venv (scripts/vllm/requirements.txt pins it); the
front is this checkout's ``pdfleet-runtime router-front``; neither needs a GPU or a cluster. Each runs its
rendered command with only the ports changed (free ones on 127.0.0.1, the router's ``--host`` already is), the
front's ``--upstream`` pointing at the router's port, and each probe is sent where the kubelet would send it:
the probe's path on the port its name gives in its container. Outside a cluster vllm-router's Kubernetes
discovery fails and it serves without workers ("Continuing without service discovery", src/server.rs:1185-1186
of its sdist): liveness 200, readiness 503. With the discovery flags swapped for a loopback prefill and decode
stand-in (``--prefill URL --decode URL``; they answer its ``/health`` checks) readiness turns 200, and back to
503 once the decode stops answering, within the rendered health-check timings. Through the front the router's
worker API (``POST /remove_worker``, ``/workers``, ...) answers 404 and the decode stays registered, while a
serving route reaches the workers; the same ``/remove_worker`` on the router's loopback port takes the decode
out (what the front keeps clients from). No request carries a key.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.router import router_deployment
from tests.vllm.harness import REPO, vllm_python

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "valid" / "vllm-qwen3.8-flash-next-nixl.yaml"
DISCOVERY = ("--service-discovery", "--service-discovery-namespace", "--service-discovery-port",
             "--prefill-selector", "--decode-selector")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with(cmd: list[str], flag: str, value: str) -> list[str]:
    i = cmd.index(flag)
    return [*cmd[:i + 1], value, *cmd[i + 2:]]


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _without(cmd: list[str], flags: tuple[str, ...]) -> list[str]:
    """``cmd`` less each of ``flags`` and the values after it."""
    out, skipping = [], False
    for arg in cmd:
        if arg.startswith("--"):
            skipping = arg in flags
        if not skipping:
            out.append(arg)
    return out


class _Health(http.server.BaseHTTPRequestHandler):
    """A vLLM pod as the router sees it: 200 on every GET (its ``/health`` checks), ``/v1/models`` naming
    ``MODELS_ID``."""

    MODELS_ID = "stand-in-model"

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": self.MODELS_ID, "object": "model"}]}).encode() \
            if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Worker:
    """A loopback stand-in that answers until ``stop`` (then its port refuses connections)."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join()
            self.server.server_close()


@contextmanager
def _worker() -> Iterator[_Worker]:
    worker = _Worker()
    try:
        yield worker
    finally:
        worker.stop()


@contextmanager
def _process(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _call(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={} if data is None else {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def _get(url: str) -> tuple[int, str]:
    return _call("GET", url)


def _until(url: str, done: Callable[[int, str], bool], procs: tuple[subprocess.Popen, ...],
           timeout: float = 60) -> tuple[int, str]:
    """GET ``url`` until ``done(status, body)`` or ``timeout``; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = _get(url)
        if done(status, body) or time.monotonic() > deadline:
            return status, body
        for proc in procs:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.3)


@pytest.fixture(scope="module")
def rendered() -> tuple[dict, dict]:
    """The router pod's router and front containers."""
    spec = PDDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    router, front = router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"]
    return router, front


class _Pod:
    """The rendered router pod on 127.0.0.1: both commands with free ports, and each probe's URL there."""

    def __init__(self, router: dict, front: dict) -> None:
        rcmd, fcmd = router["command"], front["command"]
        assert rcmd[0] == "vllm-router" and fcmd[:2] == ["pdfleet-runtime", "router-front"]
        # As rendered: the router on the pod's loopback, the front's upstream its port, the front on the http port.
        assert _value(rcmd, "--host") == "127.0.0.1"
        assert _value(fcmd, "--upstream") == f"http://127.0.0.1:{_value(rcmd, '--port')}"
        ports = {p["name"]: p["containerPort"] for c in (router, front) for p in c["ports"]}
        assert _value(fcmd, "--listen") == f"0.0.0.0:{ports['http']}"
        assert _value(rcmd, "--prometheus-port") == str(ports["metrics"])
        self.router_port, self.front_port, metrics = _free_port(), _free_port(), _free_port()
        self.router_cmd = [str(Path(vllm_python()).parent / "vllm-router"), *rcmd[1:]]
        for flag, value in (("--port", str(self.router_port)), ("--prometheus-host", "127.0.0.1"),
                            ("--prometheus-port", str(metrics))):
            self.router_cmd = _with(self.router_cmd, flag, value)
        self.front_cmd = [sys.executable, "-m", "pdfleet_runtime", *fcmd[1:]]
        self.front_cmd = _with(self.front_cmd, "--listen", f"127.0.0.1:{self.front_port}")
        self.front_cmd = _with(self.front_cmd, "--upstream", f"http://127.0.0.1:{self.router_port}")
        local = {"http": self.front_port, "metrics": metrics}
        self.probes = {kind: f"http://127.0.0.1:{local[c[kind]['httpGet']['port']]}{c[kind]['httpGet']['path']}"
                       for c in (router, front) for kind in ("readinessProbe", "livenessProbe") if kind in c}
        assert set(self.probes) == {"readinessProbe", "livenessProbe"}
        self.front = f"http://127.0.0.1:{self.front_port}"
        self.router = f"http://127.0.0.1:{self.router_port}"  # the router's loopback port (kubectl port-forward)

    @contextmanager
    def run(self, *workers: _Worker) -> Iterator[tuple[subprocess.Popen, ...]]:
        """Both processes; with ``workers`` (prefill, decode) the router's discovery flags become those URLs."""
        cmd = self.router_cmd
        if workers:
            prefill, decode = workers
            cmd = [*_without(cmd, DISCOVERY), "--prefill", prefill.url, "--decode", decode.url]
            assert "--health-check-interval-secs" in cmd  # the rendered health-check timings stay
        env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
        with ExitStack() as stack:
            procs = (stack.enter_context(_process(cmd)), stack.enter_context(_process(self.front_cmd, env)))
            yield procs


def test_rendered_router_is_live_and_not_ready_without_workers(rendered: tuple[dict, dict]) -> None:
    pod = _Pod(*rendered)
    with pod.run() as procs:
        status, body = _until(pod.probes["livenessProbe"], lambda s, _: s != 0, procs)
        assert status == 200, body
        # Until the router listens the front answers 503 router_unavailable; then the router's own 503.
        status, body = _until(pod.probes["readinessProbe"], lambda s, b: s != 0 and "router_unavailable" not in b,
                              procs)
        assert status == 503 and "no healthy prefill workers, no healthy decode workers" in body, (status, body)


def test_readiness_follows_a_healthy_prefill_and_decode(rendered: tuple[dict, dict]) -> None:
    pod = _Pod(*rendered)
    with _worker() as prefill, _worker() as decode, pod.run(prefill, decode) as procs:
        status, body = _until(pod.probes["readinessProbe"], lambda s, _: s == 200, procs)
        assert status == 200 and '"status":"ready"' in body, (status, body)
        assert _get(pod.probes["livenessProbe"])[0] == 200
        decode.stop()
        status, body = _until(pod.probes["readinessProbe"], lambda s, _: s != 200, procs, timeout=30)
        assert status == 503 and "no healthy decode workers" in body, (status, body)
        assert _get(pod.probes["livenessProbe"])[0] == 200


def _decodes(pod: _Pod) -> list[str]:
    """The decode workers the router holds, from ``GET /workers`` on its loopback port."""
    status, body = _get(f"{pod.router}/workers")
    assert status == 200, body
    return [w["url"] for w in json.loads(body)["workers"] if w["worker_type"] == "decode"]


def test_the_front_closes_vllm_routers_worker_api(rendered: tuple[dict, dict]) -> None:
    """docs/vllm.md's finding: a keyless ``POST /remove_worker`` on vllm-router's serving port took its decode
    out. Through the front it, and the rest of the worker API, is 404; the router keeps its decode."""
    pod = _Pod(*rendered)
    with _worker() as prefill, _worker() as decode, pod.run(prefill, decode) as procs:
        status, body = _until(pod.probes["readinessProbe"], lambda s, _: s == 200, procs)
        assert status == 200, body
        assert _decodes(pod) == [decode.url]
        quoted = urllib.parse.quote(decode.url, safe="")
        for method, path, body_ in (
            ("POST", f"/remove_worker?url={quoted}", None),
            ("POST", "/workers", {"url": decode.url, "worker_type": "decode"}),
            ("DELETE", f"/workers/{quoted}", None),
            ("GET", "/workers", None),
            ("GET", "/list_workers", None),
            ("POST", "/flush_cache", None),
            ("GET", "/get_loads", None),
        ):
            status, answer = _call(method, pod.front + path, body_)
            assert status == 404 and '"not_found"' in answer, (method, path, status, answer)
        assert _get(pod.probes["readinessProbe"])[0] == 200
        assert _decodes(pod) == [decode.url]
        # A serving route reaches the workers through the front and the router; a model not served stops here.
        status, answer = _get(f"{pod.front}/v1/models")
        assert status == 200 and _Health.MODELS_ID in answer, (status, answer)
        status, answer = _call("POST", f"{pod.front}/v1/completions", {"model": "other", "prompt": "hi"})
        assert status == 404 and '"model_not_found"' in answer, (status, answer)
        # What the front keeps clients from: the same call on the router's own (loopback) port removes the decode.
        status, answer = _call("POST", f"{pod.router}/remove_worker?url={quoted}")
        assert status == 200, (status, answer)
        assert _decodes(pod) == []
        status, answer = _until(pod.probes["readinessProbe"], lambda s, _: s != 200, procs, timeout=10)
        assert status == 503 and "no healthy decode workers" in answer, (status, answer)
