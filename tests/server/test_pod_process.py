"""The pod process (``pdfleet-runtime serve`` less its rank processes) starts and answers without torch.

The rank processes import torch and an engine; the pod process serving HTTP, readiness, drain and
(prefill) the bootstrap endpoint must not (import-linter checks the static imports; this checks the
running process). A probe thread inside the real ``serve`` command waits until every rank process is
up, reads ``/readyz`` and ``sys.modules``, then sends the process SIGTERM (a drain, then exit 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdfleet_runtime.testing.local import REPO, free_offset
from tests.server.harness import SECRET, config

pytestmark = pytest.mark.slow

PROBE = r"""
import json, os, signal, sys, threading, time, urllib.error, urllib.request
from pdfleet_runtime.cli import main

url, seen = sys.argv[1], {}

def probe():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                code, body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            code, body = e.code, json.loads(e.read())
        except OSError:
            time.sleep(0.2)
            continue
        if body["ranksUp"] == body["ranks"]:
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mooncake", "nixl", "triton"))
            seen.update(status=code, body=body, heavy=heavy)
            break
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=probe, daemon=True).start()
rc = main(["serve", "--config", sys.argv[2], "--bind", "127.0.0.1"])
print(json.dumps({"rc": rc, **seen}))
"""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_pod_process_answers_readyz_without_torch(tmp_path: Path, role: str) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    cfg = config(role).model_copy(update={"secret_path": secret})
    path = tmp_path / "pod.yaml"
    path.write_text(cfg.to_yaml())
    offset = free_offset()
    env = {**os.environ, "POD_NAME": f"probe-{role}", "PDFLEET_PORT_OFFSET": str(offset),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "runtime"), os.environ.get("PYTHONPATH")])),
           # A decode pod looks for prefill pods: one loopback address nobody serves, never DNS.
           "PDFLEET_PREFILL_ADDRESSES": "127.0.0.1:1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    url = f"http://127.0.0.1:{cfg.http_port + offset}"
    proc = subprocess.run([sys.executable, "-c", PROBE, url, str(path)], env=env, capture_output=True, text=True,
                          timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "body" in out, f"the ranks never came up:\n{proc.stderr[-3000:]}"
    assert out["rc"] == 0 and out["body"]["ranksUp"] == out["body"]["ranks"] == 1
    assert out["status"] == 503 and out["body"]["problem"] in ("WaitingForCanary", "PeerUnreachable"), out
    assert out["heavy"] == [], f"the pod process imported {out['heavy'][:5]}"
