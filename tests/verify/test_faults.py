"""Faults across processes, through the real engines: ranks killed with SIGKILL mid-transfer, a prefill
pod restarted elsewhere, garbage posted to a live pod.

One process group per backend (llama-dense, prefill tp 1 -> decode tp 1: three processes), driven
step by step, because each step starts from what the previous one left (a dead prefill, a decode
that still holds a link to it). Each step asserts on what the processes report: request states and
reasons, how long a failure took, and the pools' free counts (pages, slots and rows given back).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.layouts import PRESETS, pool_counts
from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
from pdfleet_runtime.verify.group import ProcessGroup
from pdfleet_runtime.verify.procs import RankProcess

pytestmark = pytest.mark.slow

LAYOUT, REQUESTS, TOKENS = "llama-dense", 2, 48
TIMEOUT_S = 12.0
FULL = {k.value: v for k, v in pool_counts(PRESETS[LAYOUT], REQUESTS, TOKENS).items()}


def transfer(w: RankProcess, attempt: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    w.send("transfer", 0, None, timeout_s, attempt)
    return w.recv(timeout_s + 60, expect="transferred")[1]  # type: ignore[no-any-return]


def wait_states(w: RankProcess, rids: list[str], want: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w.send("states", rids)
        states = w.recv(10, expect="states")[1]
        if all(states.get(r) == want for r in rids):
            return
        time.sleep(0.1)
    raise AssertionError(f"{w.name}: requests never reached {want}: {states}")


def post_garbage(host: str, port: int) -> list[int]:
    """Unsigned, malformed and oversized posts: each must get a 4xx answer, none may hurt the pod."""
    codes = []
    for body, headers in [(b"\x00\xff" * 50, {}), (b'{"version": "1.0"}', {"X-Pdfleet-Signature": "ab" * 32}),
                          (b"{" * 5000, {"X-Pdfleet-Signature": "00"}), (b"x" * (5 << 20), {})]:
        req = urllib.request.Request(f"http://{host}:{port}{MESSAGES_PATH}", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                codes.append(resp.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
        except (urllib.error.URLError, ConnectionError):
            codes.append(413)  # the server may close the connection on an oversized body: also a refusal
    return codes


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_kill_restart_and_garbage(backend: str, tmp_path: Path) -> None:
    spec = GroupSpec(backend, S(1), S(1), (CaseSpec(LAYOUT, REQUESTS, TOKENS, seed=3),), request_timeout_s=TIMEOUT_S,
                     lease_s=2.0, write_timeout_s=5.0)
    rids = [f"{spec.cases[0].name}-{{}}-{q}" for q in range(REQUESTS)]
    with ProcessGroup(spec, tmp_path) as g:
        [dec] = g.decode

        # 1. A prefill killed mid-transfer: the decode request fails with a reason within its timeout,
        #    and the decode rank frees its pages, slots and rows.
        host, port = g.open_pod()
        [pre] = g.prefill
        pre.send("serve", 0, host, port, {"attempt": "k", "stall_s": 60})
        pre.recv(60, expect="serving")
        dec.send("transfer", 0, None, TIMEOUT_S, "k")
        pre.recv(60, expect="stalling")  # both sides are Transferring: the write is in flight
        t0 = time.monotonic()
        pre.kill()
        out = dec.recv(TIMEOUT_S + 60, expect="transferred")[1]
        took = time.monotonic() - t0
        states = {o["state"] for o in out["outcomes"]}
        assert states == {"failed"}, out["outcomes"]
        assert all("prefill rank (0, 0)" in o["reason"] for o in out["outcomes"]), out["outcomes"]
        assert all(o["failure"] == "source_failed" and "stopped polling" in o["reason"] for o in out["outcomes"])
        assert took < TIMEOUT_S, took  # the lease (2 s) noticed it, not the request timeout
        assert out["free"] == FULL, "decode kept items of failed requests"

        # 2. The pod is gone for good and a new one starts elsewhere (a new port, as a new pod IP): the
        #    decode re-resolves, handshakes again, and new requests succeed byte-exact. Garbage posted
        #    to the new pod first changes nothing.
        g.close_pod(port)
        g.start_prefill(wait=True)
        host2, port2 = g.open_pod()
        assert port2 != port
        assert all(400 <= c < 500 for c in post_garbage(host2, port2))
        [pre] = g.prefill
        pre.send("serve", 0, host2, port2, {"attempt": "r"})
        pre.recv(60, expect="serving")
        out = transfer(dec, "r")
        assert out["all_success"], out["outcomes"]
        assert out["mismatched_bytes"] == 0 and out["reports_complete"]
        assert out["handshakes"] == 2 and all(o["endpoint"] == f"{host2}:{port2}" for o in out["outcomes"])
        served = pre.recv(60, expect="served")[1]
        assert served["released"] == REQUESTS and served["free_after"] == FULL

        # 3. A decode killed mid-transfer frees the prefill side: the prefill holds the decode's request
        #    (input not ready), the decode dies, then the prefill's write fails and its items are freed.
        pre.send("serve", 0, host2, port2, {"attempt": "d", "hold": True})
        pre.recv(60, expect="serving")
        dec.send("transfer", 0, None, TIMEOUT_S, "d")
        wait_states(pre, [r.format("d") for r in rids], "waiting_for_input")
        dec.kill()
        pre.send("add")
        pre.recv(10, expect="added")
        served = pre.recv(TIMEOUT_S + 30, expect="served")[1]
        assert set(served["states"].values()) == {"failed"}, served
        assert served["released"] == REQUESTS and served["free_after"] == FULL
        assert all("decode rank (0, 0)" in reason for reason in served["failures"].values()), served["failures"]
        g.close_pod(port2)
