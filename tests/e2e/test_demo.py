"""The README's main job, `pdfleet demo`, runs end to end and leaves no process behind: it ends with a chat
request through a router's Service, answered by real runtime pods, every byte verified."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def _procs_under(path: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_demo_runs_and_cleans_up(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "pdfleet_operator.cli", "demo", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=400,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "[nixl.replicated-hetero-tp]" in out  # the rejected manifest names its rule
    assert "denied the request" in out
    assert "Available=True" in out
    # The chat through the router: the curl, the answer, the verified bytes and the pods that served it.
    assert "pdfleet dev chat -n demo-chat chat" in out and "curl -sS" in out
    assert re.search(r"answer: 't\d+( t\d+)*' \((stop|length)\)", out), out[-3000:]
    assert re.search(r"bytes: \d+ of request state moved prefill -> decode, every byte verified by the decode: True",
                     out), out[-3000:]
    assert re.search(r"served by: prefill chat-prefill-\S+ \(\S+\), decode chat-decode-\S+, room \d+, routed by "
                     r"chat-router-", out), out[-3000:]
    assert "http://chat-router.demo-chat.svc:30000" in out  # kubectl get pdd's ENDPOINT
    assert "all children gone" in out
    assert _procs_under(state) == []
