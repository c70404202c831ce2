"""Replica groups through ``serve``: one replica's ranks across 2 pods (a leader and a member), real engines.

Each pod is its own ``pdfleet-runtime serve`` process (cpu pools, tcp) with its own port offset; the
member advertises 127.0.0.2 for its engines (standing in for its pod IP) and reaches its leader's group
port through ``PDFLEET_GROUP_LEADER_ADDRESS`` (the headless Service's DNS name in a cluster). Parity:
every synthetic request's bytes are checked on every decode rank against the seeded state, and the bytes
moved are the closed-form count of the layout (llama-dense: 64 tokens x 32 layers x K,V x 8 heads x 128 x
bf16, whatever the shapes). Covers issue 30's runtime acceptance: a prefill group of 2 (tp 2 x pp 2, 2 ranks
per pod) -> a decode pod, a prefill pod (pp 2) -> a decode group of 2 (tp 2 x pp 2, 2 ranks per pod), on
Mooncake and NIXL; a member killed mid-transfer fails the requests it took part in, typed (a decode member's:
``group_member_lost``; a prefill member's legs: ``peer_lost`` at once), and turns its leader
``GroupMemberLost``; a killed leader makes its member exit non-zero; a join signed with the deployment key
(not the group key) is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.config import GROUP_PORT, GroupConfig, RuntimeConfig
from pdfleet_runtime.pod.group import config_digest
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.group import GroupJoin, frame
from tests.server.harness import SECRET, Pod, config, metric

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "20", "--canary-tokens", "64", "--floor-gbps", "0")
BYTES_64 = 64 * 32 * 2 * 8 * 128 * 2
GROUP_KEY = b"group-key-of-the-role-0123456789abcdef"
MEMBER_IP = "127.0.0.2"


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for p in reversed(started):  # the last started first: a decode before its prefill, a leader before its member
        p.stop()


def group_of(workdir: Path) -> GroupConfig:
    key = workdir / "group-key"
    key.write_bytes(GROUP_KEY)
    return GroupConfig(nodes=2, service="srv-group", secret_path=key)


def start_group(workdir: Path, pods: list[Pod], name: str, cfg: RuntimeConfig, args: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> tuple[Pod, Pod]:
    """The leader (member 0) and its member 1, started at once (the leader is stopped first)."""
    leader = Pod(workdir, name, cfg, args=args, env={"PDFLEET_GROUP_MEMBER": "0", **(env or {})})
    member = Pod(workdir, f"{name}-1", cfg, args=args, env={
        "PDFLEET_GROUP_MEMBER": "1", "PDFLEET_GROUP_LEADER": name, "POD_IP": MEMBER_IP,
        "PDFLEET_GROUP_LEADER_ADDRESS": f"127.0.0.1:{GROUP_PORT + leader.offset}", **(env or {})})
    leader.start()
    pods.extend([member.start(), leader])
    return leader, member


def assert_exact(dec: Pod, n: int, prefix: str) -> None:
    for i in range(n):
        code, body = dec.synthetic(64, 30, requestId=f"{prefix}{i}", seed=i)
        assert code == 200 and body["ok"] and body["mismatchedBytes"] == 0, body
        assert body["bytes"] == BYTES_64, body


def wait_for(cond: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_prefill_group_of_two_pods_serves_a_decode_byte_exactly(tmp_path: Path, pods: list[Pod],
                                                                   backend: str) -> None:
    group = group_of(tmp_path)
    pcfg = config("prefill", tp=2, pp=2, backend=backend, group=group)
    leader, member = start_group(tmp_path, pods, "pre", pcfg, args=("--fault-write-delay", "1"))
    dec = Pod(tmp_path, "dec", config("decode", peer_tp=2, peer_pp=2, backend=backend),
              args=(*FAST, "--canary-period", "600"), env={"PDFLEET_PREFILL_ADDRESSES": leader.bootstrap})
    pods.append(dec.start())
    member.wait_ready(True, 180)
    dec.wait_ready(True, 180)
    leader.wait_ready(True, 60)
    assert_exact(dec, 3, "p")
    # The member's ranks (pipeline stage 1) wrote their legs, and the leader counted every leg of every
    # request (4 sources x 3 requests), the member's relayed over the group channel.
    legs = [line for line in member.log().splitlines() if " -> dec[0, 0]: success" in line]
    assert {"prefill[0,1]", "prefill[1,1]"} <= {line.split()[3] for line in legs}, legs[:4]
    assert metric(leader.metrics(), "pdfleet_transfers_total", role="prefill", kind="request", outcome="success") == 12
    code, health = member.get("/healthz")
    assert code == 200 and health["joined"] and health["leader"] == "pre"
    code, drained = member.admin("POST", "/drain?wait=true")  # the preStop hook: nothing to drain on a member
    assert code == 200 and drained["drained"] and member.readyz()["ready"] is True, drained
    for pod in (leader, member):  # the pod processes (not their rank processes) never load torch or an engine
        assert pod.proc is not None and heavy_libraries(pod.proc.pid) == set(), pod.name

    # The member killed while its ranks hold a request (every write is held 1 s): their legs fail at once at the
    # leader's bootstrap (peer_lost, naming the member), the decode's request fails typed, the leader turns
    # GroupMemberLost.
    out: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: out.update(r=dec.synthetic(64, 20, requestId="doomed")), daemon=True)
    sender.start()
    wait_for(lambda: "request doomed: filled" in member.log(), "the member's ranks to take the request")
    kill(member)
    sender.join(40)
    code, body = out["r"]
    assert code == 502 and body["failure"] == "source_failed" and "group member 1 lost" in body["reason"], body
    ready = leader.wait_ready(False, 20, until=lambda b: b["problem"] == "GroupMemberLost")
    assert "group member 1" in ready["reason"], ready


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_decode_group_of_two_pods_takes_a_prefill_byte_exactly(tmp_path: Path, pods: list[Pod],
                                                                 backend: str) -> None:
    pre = Pod(tmp_path, "pre", config("prefill", pp=2, peer_tp=2, peer_pp=2, backend=backend))
    pods.append(pre.start())
    dcfg = config("decode", tp=2, pp=2, peer_pp=2, backend=backend, group=group_of(tmp_path))
    leader, member = start_group(tmp_path, pods, "dec", dcfg, args=(*FAST, "--canary-period", "600"),
                                 env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    member.wait_ready(True, 180)
    leader.wait_ready(True, 180)
    assert_exact(leader, 3, "d")
    # The member's decode ranks (pipeline stage 1) registered with their own address for their engines and
    # checked their own bytes.
    got = [ln.split()[3] for ln in member.log().splitlines() if " <- " in ln and ": success" in ln]
    assert got.count("decode[0,1]") >= 3 and got.count("decode[1,1]") >= 3, got

    # The leader killed (no drain): its member exits non-zero (the operator restarts the group as a unit).
    kill(leader)
    rc = member.wait(30)
    assert rc is not None and rc != 0, member.log()[-2000:]
    assert "leader lost" in member.log()


def test_a_member_killed_mid_transfer_fails_the_request_and_its_leader_reports_group_member_lost(
        tmp_path: Path, pods: list[Pod]) -> None:
    pre = Pod(tmp_path, "pre", config("prefill", peer_tp=2), args=("--fault-write-delay", "2"))
    pods.append(pre.start())
    dcfg = config("decode", tp=2, group=group_of(tmp_path))
    leader, member = start_group(tmp_path, pods, "dec", dcfg, args=(*FAST, "--canary-period", "600"),
                                 env={"PDFLEET_PREFILL_ADDRESSES": pre.bootstrap})
    leader.wait_ready(True, 180)

    # A join signed with the deployment key (a pod of the other role holds it) is refused unread.
    refusal = forged_join(leader, dcfg.model_copy(update={"secret_path": leader.cfg.secret_path}))
    assert refusal["body"]["code"] == "bad_signature", refusal
    assert leader.readyz()["ready"] is True  # ... and changes nothing

    out: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: out.update(r=leader.synthetic(64, 20, requestId="doomed")), daemon=True)
    sender.start()
    wait_for(lambda: "doomed" in pre.log(), "the prefill to take the request")
    time.sleep(0.5)  # inside the held write
    kill(member)
    sender.join(40)
    code, body = out["r"]
    assert code == 502 and body["failure"] == "group_member_lost", body
    ready = leader.wait_ready(False, 20, until=lambda b: b["problem"] == "GroupMemberLost")
    assert "group member 1" in ready["reason"], ready
    code, again = leader.synthetic(64, 20, requestId="after")  # refused at once: the group is incomplete
    assert code == 503 and "group member 1" in again["error"], again


def kill(pod: Pod) -> None:
    """SIGKILL of the pod's process group: gone at once, no drain."""
    assert pod.proc is not None
    os.killpg(pod.proc.pid, signal.SIGKILL)
    pod.proc.wait(10)


def heavy_libraries(pid: int) -> set[str]:
    """Which of torch, Mooncake and NIXL the process ``pid`` has mapped (its shared libraries)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {lib for lib in ("libtorch", "mooncake", "nixl") if lib in maps}


def forged_join(leader: Pod, cfg: RuntimeConfig) -> dict[str, Any]:
    """A well-formed join signed with the deployment key; the leader's answer (its raw envelope)."""
    codec = Codec(SECRET, "intruder")
    join = GroupJoin(member=1, role=cfg.role, ranks=cfg.local_world, config_digest=config_digest(leader.cfg),
                     wire="1.0")
    raw, sig, _ = codec.seal(join)
    with socket.create_connection(("127.0.0.1", GROUP_PORT + leader.offset), timeout=10) as s:
        s.sendall(frame(raw, sig))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data[68:])


