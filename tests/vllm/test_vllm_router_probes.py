"""vllm-router 0.1.17 itself answers the probes of the router container pdfleet renders.

The router is the ``vllm-router`` script of the vLLM check venv (scripts/vllm/requirements.txt pins it); it
needs no GPU and no cluster. It runs the rendered command with only the addresses changed (127.0.0.1 and free
ports), and each probe is sent where the kubelet would send it: the probe's path on the port its name gives.
Outside a cluster vllm-router's Kubernetes discovery fails and it serves without workers ("Continuing without
service discovery", src/server.rs:1185-1186 of its sdist): liveness 200, readiness 503. With the discovery
flags swapped for a loopback prefill and decode stand-in (``--prefill URL --decode URL``; they answer its
``/health`` checks) readiness turns 200, and back to 503 once the decode stops answering, within the rendered
health-check timings. No probe carries a key.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    """A vLLM pod as the router's health check sees it: 200 on every GET."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

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
def _router(argv: list[str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def _until(url: str, done: Callable[[int], bool], proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        status, body = _get(url)
        if done(status) or time.monotonic() > deadline:
            return status, body
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.3)


@pytest.fixture(scope="module")
def rendered() -> dict:
    spec = PDDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    [container] = router_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"]
    return container


def _probe_urls(container: dict, port: int) -> dict[str, str]:
    """Each probe's URL on a router whose rendered ``--port`` was replaced by ``port``."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    rendered_port = int(container["command"][container["command"].index("--port") + 1])
    out = {}
    for kind in ("readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert ports[get["port"]] == rendered_port, (kind, get, ports)  # the probe reaches the serving port
        out[kind] = f"http://127.0.0.1:{port}{get['path']}"
    return out


def _local(container: dict) -> tuple[list[str], int]:
    cmd, port = container["command"], _free_port()
    assert cmd[0] == "vllm-router"
    cmd = [str(Path(vllm_python()).parent / "vllm-router"), *cmd[1:]]
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port)), ("--prometheus-host", "127.0.0.1"),
                        ("--prometheus-port", str(_free_port()))):
        cmd = _with(cmd, flag, value)
    return cmd, port


def test_rendered_router_is_live_and_not_ready_without_workers(rendered: dict) -> None:
    cmd, port = _local(rendered)
    urls = _probe_urls(rendered, port)
    with _router(cmd) as proc:
        status, body = _until(urls["livenessProbe"], lambda s: s != 0, proc)
        assert status == 200, body
        status, body = _get(urls["readinessProbe"])
        assert status == 503 and "no healthy prefill workers, no healthy decode workers" in body, (status, body)


def test_readiness_follows_a_healthy_prefill_and_decode(rendered: dict) -> None:
    cmd, port = _local(rendered)
    urls = _probe_urls(rendered, port)
    with _worker() as prefill, _worker() as decode:
        direct = [*_without(cmd, DISCOVERY), "--prefill", prefill.url, "--decode", decode.url]
        assert "--health-check-interval-secs" in direct  # the rendered health-check timings stay
        with _router(direct) as proc:
            status, body = _until(urls["readinessProbe"], lambda s: s == 200, proc)
            assert status == 200 and '"status":"ready"' in body, (status, body)
            assert _get(urls["livenessProbe"])[0] == 200
            decode.stop()
            status, body = _until(urls["readinessProbe"], lambda s: s != 200, proc, timeout=30)
            assert status == 503 and "no healthy decode workers" in body, (status, body)
            assert _get(urls["livenessProbe"])[0] == 200
