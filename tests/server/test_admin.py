"""Issue 25 item 1: nobody outside the pod can drain it.

A real ``serve`` process whose HTTP port listens on 127.0.0.2 (standing in for the pod IP, which the
NetworkPolicy opens to every source): ``GET``, ``POST`` and ``DELETE /drain`` there are refused and the
pod stays serving; the admin port answers only on 127.0.0.1 (loopback inside the pod, where the
kubelet's ``exec`` preStop hook runs ``pdfleet-runtime drain``), never by GET, and that command drains.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdfleet_runtime.testing.local import REPO
from tests.server.harness import Pod, config, http

pytestmark = pytest.mark.slow

POD_IP = "127.0.0.2"


def test_drain_is_refused_from_another_address_and_taken_from_the_pods_loopback(tmp_path: Path) -> None:
    pod = Pod(tmp_path, "dec", config("decode"), args=("--bind", POD_IP, "--no-gate"))
    url = f"http://{POD_IP}:{pod.cfg.http_port + pod.offset}"
    admin_port = pod.cfg.admin_port + pod.offset
    pod.start()
    try:
        _wait_up(url)
        for method in ("GET", "POST", "DELETE", "PUT", "PATCH"):  # issue 39 found 404 for every method: kept
            code, body = http(method, url + "/drain?wait=true", None, 10)
            assert code == 404, (method, code, body)
            assert http("GET", url + "/healthz", None, 10)[1]["phase"] == "serving", method
        with socket.socket() as s:  # the admin port does not listen on the pod's address
            assert s.connect_ex((POD_IP, admin_port)) != 0
        admin = f"http://127.0.0.1:{admin_port}"
        code, _ = http("GET", admin + "/drain", None, 10)
        assert code == 405  # never by GET, even from inside the pod
        env = {**os.environ, "PYTHONPATH": str(REPO / "runtime"), "PDFLEET_PORT_OFFSET": str(pod.offset)}
        out = subprocess.run([sys.executable, "-m", "pdfleet_runtime", "drain", "--config", str(pod.config_path),
                              "--wait"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert '"drained": true' in out.stdout, out.stdout
        assert http("GET", url + "/healthz", None, 10)[1]["phase"] == "drained"
        code, body = http("DELETE", admin + "/drain", None, 10)
        assert code == 200 and body["phase"] == "serving", body
    finally:
        pod.stop()


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            code, _ = http("GET", url + "/healthz", None, 5)
            if code in (200, 503):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered /healthz")
