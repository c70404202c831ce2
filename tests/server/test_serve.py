"""``pdfleet-runtime serve`` as real processes on loopback: a prefill pod and a decode pod (tp 1, llama-dense,
Mooncake over TCP, cpu pools), driven over HTTP as the kubelet, a router and Prometheus would.

Covers issue 8's acceptance: readiness says why a decode cannot use its prefill (unreachable, another
wire version, another layout, below the throughput floor) and turns ready once that is fixed; a drain
with transfers in flight finishes every one exactly once; SIGTERM under load exits within the budget
with no failed transfer; /metrics parses with prometheus_client's parser and moves with traffic.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.layouts import PRESETS, layout_digest
from tests.server.harness import Pod, config, free_offset, metric

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "3", "--canary-tokens", "64")
BYTES_64 = 64 * 32 * 2 * 8 * 128 * 2  # llama-dense: 64 tokens x 32 layers x (K, V) x 8 heads x 128 x bf16


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for p in started:
        p.stop()


def start(pods: list[Pod], pod: Pod) -> Pod:
    pods.append(pod)
    return pod.start()


def test_readiness_names_each_problem_and_recovers_when_fixed(tmp_path: Path, pods: list[Pod]) -> None:
    offset = free_offset()  # every prefill incarnation takes the same address, as a restarted pod behind DNS
    prefill_addr = f"127.0.0.1:{config('prefill').bootstrap_port + offset}"
    dec = start(pods, Pod(tmp_path, "dec", config("decode"), args=FAST,
                          env={"PDFLEET_PREFILL_ADDRESSES": prefill_addr}))

    def prefill(name: str, *args: str, layout: Any = "llama-dense") -> Pod:
        return start(pods, Pod(tmp_path, name, config("prefill", layout=layout), offset=offset, args=args))

    def not_ready(problem: str, says: str) -> dict[str, Any]:
        """The verdict of a check made after the last change (a stale one names another problem); when it never
        comes, the failure shows the prefill pod's log too (an exited or slow prefill is the likely cause)."""
        try:
            return dec.wait_ready(False, 60, until=lambda b: b.get("problem") == problem and says in b["reason"])
        except AssertionError as e:
            peer = pods[-1] if pods[-1] is not dec else None
            if peer is None:
                raise
            state = "running" if peer.proc is not None and peer.proc.poll() is None else "exited"
            raise AssertionError(f"{e}\n--- {peer.name} ({state}):\n{peer.log()[-3000:]}") from None

    # 1. Nothing listens at the prefill's address.
    body = not_ready("PeerUnreachable", "unreachable")
    assert prefill_addr in body["reason"]

    # 2. A prefill pod speaking another wire version refuses the handshake; the reason names both.
    p = prefill("pre-wire", "--fault-wire", "2.0")
    body = not_ready("PeerIncompatible", "wire protocol")
    assert "2.0" in body["reason"] and "1.0" in body["reason"], body
    p.stop()

    # 3. A prefill pod with another layout (half the KV heads): the handshake compares the layouts' digests (wire
    #    1.3) and the prefill refuses the decode before anything is planned; the reason names both digests.
    other = PRESETS["llama-dense"].model_copy(update={"kv_heads": 4})
    p = prefill("pre-layout", layout=other.model_dump(mode="json", by_alias=True))
    body = not_ready("PeerIncompatible", "two layout generations")
    assert layout_digest(other) in body["reason"] and layout_digest(PRESETS["llama-dense"]) in body["reason"], body
    p.stop()

    # 4. A compatible prefill pod on a link too slow for the floor (every write takes 0.5 s: ~16 MB/s).
    p = prefill("pre-slow", "--fault-write-delay", "0.5")
    body = not_ready("BelowThroughputFloor", "below the floor 0.05 GB/s")
    assert body["peers"][0]["gbps"] < 0.05, body
    assert p.readyz()["ready"] is True  # the prefill pod itself wrote a canary: its own path works
    p.stop()

    # 5. Fixed: a healthy prefill pod at the same address. Both pods turn ready, the gauge too.
    p = prefill("pre-ok")
    body = dec.wait_ready(True, 60)
    assert body["problem"] == "TransferPathVerified" and body["peers"][0]["gbps"] >= 0.05
    p.wait_ready(True, 30)
    assert metric(dec.metrics(), "pdfleet_ready") == 1.0


def test_drain_finishes_in_flight_transfers_once_and_metrics_move(tmp_path: Path, pods: list[Pod]) -> None:
    pre = start(pods, Pod(tmp_path, "pre", config("prefill", requests=6, tokens=1024),
                          args=("--fault-write-delay", "1.0")))
    dec = start(pods, Pod(tmp_path, "dec", config("decode", requests=6, tokens=1024),
                          args=(*FAST, "--floor-gbps", "0.001", "--canary-period", "60"),
                          env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap}))
    dec.wait_ready(True, 90)
    pre.wait_ready(True, 30)
    before = dec.metrics()
    assert metric(before, "pdfleet_transfers_total", role="decode", kind="request", outcome="success") == 0

    with ThreadPoolExecutor(4) as pool:
        # Decode drain: three requests are in flight (each write takes a second) when it starts.
        futs = [pool.submit(dec.synthetic, 64, 30, requestId=f"d{i}") for i in range(3)]
        wait_for(lambda: metric(dec.metrics(), "pdfleet_transfers_in_flight", role="decode") >= 3, "3 in flight")
        code, drained = dec.admin("POST", "/drain?wait=true", timeout_s=30)
        assert code == 200 and drained["drained"] and not drained["forced"] and drained["inFlight"] == 0, drained
        results = [f.result() for f in futs]
        assert [c for c, _ in results] == [200] * 3 and all(b["ok"] and b["mismatchedBytes"] == 0
                                                            for _, b in results), results
        code, refused = dec.synthetic(64)
        assert code == 503 and "draining" in refused["error"]
        assert dec.readyz()["problem"] == "Draining" and metric(dec.metrics(), "pdfleet_draining") == 1
        code, back = dec.admin("DELETE", "/drain")
        assert back["phase"] == "serving"
        dec.wait_ready(True, 30)

        # Prefill drain: two requests in flight; the pod refuses new ones (the decode says so, 503).
        futs = [pool.submit(dec.synthetic, 64, 30, requestId=f"p{i}") for i in range(2)]
        wait_for(lambda: metric(pre.metrics(), "pdfleet_transfers_in_flight", role="prefill") >= 2, "2 in flight")
        code, drained = pre.admin("POST", "/drain?wait=true")
        assert code == 200 and drained["drained"] and not drained["forced"], drained
        assert [f.result()[0] for f in futs] == [200, 200]
        code, refused = dec.synthetic(64)
        assert code == 503 and refused["failure"] == "draining", refused
        assert pre.readyz()["problem"] == "Draining"

    # Every request arrived verified, exactly once on each side; nothing failed.
    ids = ["d0", "d1", "d2", "p0", "p1"]
    pre_log, dec_log = pre.log(), dec.log()
    for rid in ids:
        assert len(re.findall(rf"request {rid} -> dec\[0, 0\]: success", pre_log)) == 1, rid
        assert len(re.findall(rf"request {rid} <- \S+: success", dec_log)) == 1, rid
    after, pre_m = dec.metrics(), pre.metrics()
    assert metric(after, "pdfleet_transfers_total", role="decode", kind="request", outcome="success") == 5
    assert metric(after, "pdfleet_transfer_bytes_total", role="decode", kind="request") == 5 * BYTES_64
    assert metric(after, "pdfleet_transfer_seconds_count", role="decode", kind="request") == 5
    assert metric(after, "pdfleet_transfer_seconds_bucket", role="decode", kind="request", le="0.5") == 0  # 1 s writes
    assert metric(pre_m, "pdfleet_transfers_total", role="prefill", kind="request", outcome="success") == 5
    assert metric(pre_m, "pdfleet_transfers_total", role="prefill", kind="canary", outcome="success") >= 1
    # No request transfer failed on either side (a canary may time out on a loaded CI host; that is
    # readiness's business, counted under kind="canary").
    for role, samples in (("decode", after), ("prefill", pre_m)):
        assert metric(samples, "pdfleet_transfers_total", role=role, kind="request", outcome="failed") == 0, role
    assert metric(after, "pdfleet_drains_total", result="drained") == 1
    assert metric(pre_m, "pdfleet_transport_info", rank="prefill[0,0]", backend="mooncake", requested="tcp",
                  engine_protocol="tcp", effective="tcp", pinned="true") == 1


def test_sigterm_under_load_exits_within_the_budget_with_no_failed_transfer(tmp_path: Path, pods: list[Pod]) -> None:
    budget = 15
    pre = start(pods, Pod(tmp_path, "pre", config("prefill", requests=6, tokens=1024),
                          args=("--fault-write-delay", "0.3")))
    dec = start(pods, Pod(tmp_path, "dec", config("decode", requests=6, tokens=1024, drain_s=budget),
                          args=(*FAST, "--floor-gbps", "0.001", "--canary-period", "60"),
                          env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap}))
    dec.wait_ready(True, 90)
    codes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                code, _ = dec.synthetic(64, 20)
            except OSError:  # the pod has exited: the load is over
                return
            codes.append(code)
            if code != 200:
                time.sleep(0.05)  # refused while draining: a client backs off

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: codes.count(200) >= 3, "requests flowing")
    wait_for(lambda: metric(dec.metrics(), "pdfleet_transfers_in_flight", role="decode") >= 2, "2 in flight")
    t0 = time.monotonic()
    dec.signal(signal.SIGTERM)
    rc = dec.wait(budget + 10)
    took = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(30)
    assert rc == 0, dec.log()[-3000:]
    assert took < budget, took
    assert 502 not in codes and codes.count(200) >= 5, codes  # refused after the drain began (503), never failed
    log = dec.log()
    assert "drain finished" in log and " failed (" not in log, log[-3000:]
    assert metric(pre.metrics(), "pdfleet_transfers_total", role="prefill", kind="request", outcome="failed") == 0


def test_requests_skip_a_prefill_pod_that_went_away_while_dns_still_names_it(tmp_path: Path,
                                                                            pods: list[Pod]) -> None:
    """Two prefill pods in the decode's addresses file (what kube-dns answers); one is killed without a
    drain and stays listed. A request routed to it never reached it (no connection): within the 2 s
    grace it goes to the other pod and succeeds, and the dead one is tried last from then on."""
    import os

    from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver

    a, b = (start(pods, Pod(tmp_path, f"pre-{n}", config("prefill"))) for n in "ab")
    dns = tmp_path / "dns.json"
    FileResolver.write(dns, [Endpoint("127.0.0.1", int(p.bootstrap.rpartition(":")[2])) for p in (a, b)])
    dec = start(pods, Pod(tmp_path, "dec", config("decode"), args=(*FAST, "--canary-period", "60"),
                          env={"PDFLEET_PREFILL_ADDRESSES_FILE": str(dns)}))
    dec.wait_ready(True, 90, until=lambda r: sum(p["ok"] for p in r["peers"]) == 2)
    assert {dec.synthetic(64, 20, requestId=f"w{i}")[1]["prefill"] for i in range(4)} == {a.bootstrap, b.bootstrap}
    assert a.proc is not None
    os.killpg(a.proc.pid, signal.SIGKILL)  # gone at once, no drain; the file still names it
    a.proc.wait(10)
    time.sleep(0.3)
    for i in range(4):  # round robin over both verified pods: the first one routed to the dead pod fails over
        t0 = time.monotonic()
        code, body = dec.synthetic(64, 20, requestId=f"after{i}")
        assert code == 200 and body["ok"] and body["mismatchedBytes"] == 0 and body["prefill"] == b.bootstrap, body
        assert time.monotonic() - t0 < 2.0 + 3.0, (i, time.monotonic() - t0)
    assert len(re.findall(r"request after\d+ <- \S+: success", dec.log())) == 4


def wait_for(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
