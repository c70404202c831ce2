"""Issue 25 acceptance 3: a decode pod killed while a prefill writes into it, on the real Mooncake and NIXL engines.

A prefill pod and a decode pod run as ``serve`` processes (cpu pools, tcp); the prefill's writes are
held 2 s before the engine call (``--fault-write-delay``), so the decode can be killed (SIGKILL of
its process group: no drain, no cancel) with the write in flight. Then the prefill must end that
request with a failed, fenced status (its write returned), free its side (nothing in flight), and
the next request, from a new decode pod, must succeed with every byte verified.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.harness import Pod, config, metric

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "10", "--canary-tokens", "64", "--floor-gbps", "0")


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for p in started:
        p.stop()


def wait_for(cond: Any, what: str, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_decode_killed_during_a_write_is_fenced_freed_and_the_next_request_succeeds(
        tmp_path: Path, pods: list[Pod], backend: str) -> None:
    pre = Pod(tmp_path, "pre", config("prefill", backend=backend),
              args=("--fault-write-delay", "2", "--write-timeout", "5"))
    pods.append(pre.start())
    dec = Pod(tmp_path, "dec-a", config("decode", backend=backend), args=(*FAST, "--canary-period", "600"),
              env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    pods.append(dec.start())
    dec.wait_ready(True, 120)
    out: dict[str, Any] = {}
    def send() -> None:
        try:
            out["r"] = dec.synthetic(64, 20, requestId="doomed")
        except OSError as e:  # the decode pod dies before it answers
            out["r"] = e

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    wait_for(lambda: "doomed" in pre.log(), "the prefill to take the request")
    time.sleep(0.8)  # inside the held write
    assert dec.proc is not None
    os.killpg(dec.proc.pid, signal.SIGKILL)
    dec.proc.wait(10)

    # The prefill's write to the dead decode returns (failed), its status is final and its items freed.
    wait_for(lambda: re.search(r"request doomed -> dec-a\[0, 0\]: failed", pre.log()), "the prefill to fail it")
    print(next(line for line in pre.log().splitlines() if re.search(r"request doomed -> .*failed", line)))
    wait_for(lambda: metric(pre.metrics(), "pdfleet_transfers_in_flight", role="prefill") == 0,
             "the prefill to free its side")
    assert metric(pre.metrics(), "pdfleet_transfers_total", role="prefill", kind="request", outcome="failed") >= 1
    assert pre.proc is not None and pre.proc.poll() is None  # the prefill pod lives on

    # The next request, from a new decode pod, succeeds byte for byte.
    dec2 = Pod(tmp_path, "dec-b", config("decode", backend=backend), args=(*FAST, "--canary-period", "600"),
               env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    pods.append(dec2.start())
    dec2.wait_ready(True, 120)
    code, body = dec2.synthetic(64, 20, requestId="next")
    assert code == 200 and body["ok"] and body["mismatchedBytes"] == 0, body
