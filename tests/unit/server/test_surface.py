"""The server's small parts without processes: options and their local-run overrides, the gate writer,
metrics rendering, seeded synthetic state, the allocator's public free counts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdfleet_runtime.config import GroupConfig, ModelSourceConfig, RuntimeConfig
from pdfleet_runtime.layouts import PRESETS, IndexKind, LayoutRef, pool_counts
from pdfleet_runtime.planner import Blocks, compile_destination
from pdfleet_runtime.pod.app import PodServer
from pdfleet_runtime.pod.gate import KubeGate, NoGate, make_gate
from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.pod.options import KvConnector, OptionsError, ServeOptions, parse_addresses
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver
from pdfleet_runtime.protocol.messages import RequestKind
from pdfleet_runtime.rank.synthetic import (
    corrupt_request,
    fill_request,
    request_bytes,
    verify_request,
)
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.seeded import request_seed
from pdfleet_runtime.verify.arena import LocalCopyExecutor


def cfg(**kw: Any) -> RuntimeConfig:
    base = dict(deployment="d", namespace="ns", role="decode", runtime_version="0.1.0",
                layout=LayoutRef(preset="llama-dense"), shape=ParallelShape(2), peer_shape=ParallelShape(1),
                backend="mooncake", protocol="tcp", max_concurrent_requests=2, kv_tokens=128,
                prefill_service="d-prefill", secret_path=Path("/s"))
    return RuntimeConfig(**{**base, **kw})


def test_options_take_the_local_overrides_from_the_environment_and_flags_win() -> None:
    env = {"PDFLEET_PORT_OFFSET": "100", "PDFLEET_PREFILL_ADDRESSES": "127.0.0.1:9100, [::1]:9101",
           "POD_NAME": "d-decode-abc-0", "POD_IP": "10.1.2.3"}
    o = ServeOptions.build(cfg(), env)
    assert (o.http_port, o.bootstrap_port, o.engine_port) == (8180, 9098, 17100)
    assert o.prefill_addresses == (("127.0.0.1", 9100), ("::1", 9101))
    assert o.instance == "d-decode-abc-0" and o.advertise_host == "10.1.2.3" and o.floor == 0.05
    o = ServeOptions.build(cfg(protocol="rdma"), env, port_offset=5, floor_gbps=None, canary_tokens=8)
    assert o.http_port == 8085 and o.floor == 5.0 and o.canary_tokens == 8


def test_a_decode_without_its_kv_connector_is_a_setting_of_seeded_decodes_only() -> None:
    assert ServeOptions.build(cfg(), {}).kv_connector is KvConnector.PDFLEET
    assert ServeOptions.build(cfg(), {"PDFLEET_KV_CONNECTOR": "none"}).kv_connector is KvConnector.NONE
    assert ServeOptions.build(cfg(), {"PDFLEET_KV_CONNECTOR": "none"}, kv_connector="pdfleet").kv_connector \
        is KvConnector.PDFLEET  # a flag wins
    with pytest.raises(OptionsError, match="PDFLEET_KV_CONNECTOR='nixl' is not one of"):
        ServeOptions.build(cfg(), {"PDFLEET_KV_CONNECTOR": "nixl"})
    with pytest.raises(OptionsError, match="unset it on this prefill"):
        ServeOptions.build(cfg(role="prefill"), {"PDFLEET_KV_CONNECTOR": "none"})
    model = cfg(model=ModelSourceConfig(path=Path("/models/m")))
    with pytest.raises(OptionsError, match="unset it on this model pod"):
        ServeOptions.build(model, {"PDFLEET_KV_CONNECTOR": "none"})


def test_a_group_members_options_come_from_its_pod_environment() -> None:
    group = cfg(group=GroupConfig(nodes=2, service="d-decode-group", secret_path=Path("/g")))
    env = {"PDFLEET_GROUP_MEMBER": "1", "PDFLEET_GROUP_LEADER": "d-decode-0-0", "PDFLEET_PORT_OFFSET": "3"}
    o = ServeOptions.build(group, env)
    assert o.is_member and not o.is_leader and o.group_port == 9000
    assert o.leader_address == ("d-decode-0-0.d-decode-group.ns.svc", 8997)  # the leader's own port, not offset
    o = ServeOptions.build(group, {**env, "PDFLEET_GROUP_LEADER_ADDRESS": "127.0.0.1:9100"})
    assert o.leader_address == ("127.0.0.1", 9100)
    assert ServeOptions.build(group, {"PDFLEET_GROUP_MEMBER": "0"}).is_leader
    assert not ServeOptions.build(cfg(), {}).is_leader
    for bad, says in (({"PDFLEET_GROUP_MEMBER": "2"}, "0 to 1"), ({"PDFLEET_GROUP_MEMBER": "x"}, "0 to 1"),
                      ({"PDFLEET_GROUP_MEMBER": "1"}, "PDFLEET_GROUP_LEADER")):
        with pytest.raises(OptionsError, match=says):
            ServeOptions.build(group, bad)
    with pytest.raises(OptionsError, match="has no group"):
        ServeOptions.build(cfg(), {"PDFLEET_GROUP_MEMBER": "1"})


def test_an_addresses_file_is_re_read_on_every_resolve_as_dns_would_answer(tmp_path: Path) -> None:
    path = tmp_path / "prefill.json"
    o = ServeOptions.build(cfg(), {"PDFLEET_PREFILL_ADDRESSES_FILE": str(path)})
    assert o.prefill_addresses_file == path and o.prefill_addresses == ()
    assert ServeOptions.build(cfg(), {}, prefill_addresses_file=path).prefill_addresses_file == path
    server = PodServer(o)
    FileResolver.write(path, [Endpoint("127.0.0.1", 9100)])
    assert server.resolver.resolve() == [Endpoint("127.0.0.1", 9100)]
    FileResolver.write(path, [Endpoint("127.0.0.1", 9101), Endpoint("127.0.0.1", 9100)])  # a new pod came
    assert server.resolver.resolve() == [Endpoint("127.0.0.1", 9100), Endpoint("127.0.0.1", 9101)]
    with pytest.raises(OptionsError, match="both set"):
        ServeOptions.build(cfg(), {"PDFLEET_PREFILL_ADDRESSES_FILE": str(path),
                                   "PDFLEET_PREFILL_ADDRESSES": "127.0.0.1:9100"})


@pytest.mark.parametrize(("env", "flags", "says"), [
    ({"PDFLEET_PORT_OFFSET": "x"}, {}, "PDFLEET_PORT_OFFSET"),
    ({}, {"port_offset": 60000}, "outside"),
    ({"PDFLEET_PREFILL_ADDRESSES": "nohost"}, {}, "host:port"),
    ({}, {"canary_tokens": 0}, "positive"),
])
def test_bad_overrides_are_refused_naming_them(env: dict[str, str], flags: dict[str, Any], says: str) -> None:
    with pytest.raises(OptionsError, match=says):
        ServeOptions.build(cfg(), env, **flags)
    with pytest.raises(OptionsError):
        parse_addresses(" , ")


def test_the_gate_patches_its_condition_with_a_strategic_merge() -> None:
    calls: list[tuple[Any, ...]] = []

    class Api:
        def patch_namespaced_pod_status(self, *args: Any, **kwargs: Any) -> None:
            calls.append((*args, kwargs))

    gate = KubeGate(Api(), "ns", "pod-0", "pdfleet.io/transfer-path")
    asyncio.run(gate.set(False, "BelowThroughputFloor", "canary 0.01 GB/s below 0.05"))
    [(pod, ns, body, kwargs)] = calls
    [cond] = body["status"]["conditions"]
    assert (pod, ns) == ("pod-0", "ns") and kwargs == {"_content_type": "application/strategic-merge-patch+json"}
    assert cond["type"] == "pdfleet.io/transfer-path" and cond["status"] == "False"
    assert cond["reason"] == "BelowThroughputFloor" and "0.01" in cond["message"]


def test_no_gate_is_written_without_a_pod_name_a_cluster_or_when_disabled(tmp_path: Path) -> None:
    assert isinstance(make_gate(True, "ns", "", "g"), NoGate)
    assert isinstance(make_gate(False, "ns", "p", "g", tmp_path / "kubeconfig"), NoGate)
    assert isinstance(make_gate(True, "ns", "p", "g", token=tmp_path / "absent"), NoGate)


def test_metrics_render_in_the_text_format_and_count() -> None:
    m = ServerMetrics("decode")
    m.in_flight_from(lambda: 2.0)
    m.transfer(RequestKind.REQUEST, True, 1000, 0.02)
    m.transfer(RequestKind.ROOM, False, 0, 0.0, "source_failed")  # a room's claim counts as a request
    m.transfer(RequestKind.CANARY, True, 10, 0.01)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("pdfleet_transfers_total", (("kind", "request"), ("outcome", "success"), ("role", "decode")))] == 1
    assert samples[("pdfleet_transfer_bytes_total", (("kind", "request"), ("role", "decode")))] == 1000
    assert samples[("pdfleet_transfers_total", (("kind", "request"), ("outcome", "failed"), ("role", "decode")))] == 1
    assert samples[("pdfleet_transfer_bytes_total", (("kind", "canary"), ("role", "decode")))] == 10
    assert samples[("pdfleet_transfer_failures_total", (("reason", "source_failed"), ("role", "decode")))] == 1
    assert samples[("pdfleet_transfers_in_flight", (("role", "decode"),))] == 2.0
    assert fams["pdfleet_transfer_seconds"].type == "histogram"


def test_synthetic_state_verifies_on_another_shape_and_not_under_another_seed() -> None:
    lay = PRESETS["qwen3-next-hybrid"]
    cap = Capacity(2, 96)
    a = RequestAllocator(lay, cap, seed=1).allocate(70)
    b = RequestAllocator(lay, cap, seed=2).allocate(70)
    seed = request_seed("r1")
    assert seed != request_seed("r2") and 0 <= seed < 2**63
    # Two TP ranks fill their shards; the planner moves them into one TP 1 rank, which must verify.
    src = [RankPools(lay, ParallelShape(2), t, 0, cap) for t in range(2)]
    for p in src:
        fill_request(p, seed, a)
    dst = RankPools(lay, ParallelShape(1), 0, 0, cap)
    assert verify_request(dst, seed, b) > 0  # zeros are not the state
    dest = compile_destination(dst.registration(), [p.registration() for p in src])
    LocalCopyExecutor([p.arena for p in (*src, dst)]).execute(Blocks.concat(list(dest.plan(a, b).values())))
    assert verify_request(dst, seed, b) == 0
    assert verify_request(dst, request_seed("r2"), b) > 0
    assert request_bytes(dst, b) > 0
    corrupt_request(dst, b)  # the fault of an image that mangles what it receives: one byte
    assert verify_request(dst, seed, b) == 1


def test_free_counts_are_public_and_move_with_allocations() -> None:
    lay, cap = PRESETS["llama-dense"], Capacity(2, 64)
    alloc = RequestAllocator(lay, cap)
    full = pool_counts(lay, 2, 64)
    assert alloc.free_counts() == full
    idx = alloc.allocate(20)
    assert alloc.free_counts()[IndexKind.PAGE] == full[IndexKind.PAGE] - 2
    assert alloc.free_counts()[IndexKind.SLOT] == full[IndexKind.SLOT] - 1
    alloc.free(idx)
    assert alloc.free_counts() == full
