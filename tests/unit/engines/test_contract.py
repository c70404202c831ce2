"""The engine contract without real engines: the local engine, states, peer info, the lazy registry,
MORI's refusal and the mapping of engine failures to typed errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pdfleet_runtime.engines import (
    BlockRangeError,
    EngineConfig,
    EngineState,
    EngineStateError,
    EngineUnavailable,
    FailureKind,
    HandshakeError,
    PeerInfo,
    PeerUnreachable,
    TransferFailed,
    TransferStatus,
    UnknownPeer,
    backend_capabilities,
    create_engine,
)
from pdfleet_runtime.engines.blocks import Granule
from pdfleet_runtime.engines.mooncake import map_write_failure
from pdfleet_runtime.engines.nixl import map_nixl_error, memory_type
from pdfleet_runtime.records import RegionRecord
from pdfleet_runtime.transfer import Protocol


def _pair(chunk: int = 3) -> tuple[object, object, np.ndarray, np.ndarray, str]:
    a, b = (create_engine(EngineConfig("local", max_batch_entries=chunk)) for _ in range(2))
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    for eng, arr in ((a, src), (b, dst)):
        eng.start()
        eng.register([RegionRecord(arr.ctypes.data, arr.size, "cpu")])
    peer = a.connect(b.local_info())
    return a, b, src, dst, peer


def test_local_engine_writes_byte_exact_in_chunks() -> None:
    a, _, src, dst, peer = _pair()
    s0, d0 = src.ctypes.data, dst.ctypes.data
    t = a.submit(peer, (np.array([s0, s0 + 100, s0 + 4000, s0 + 7]), np.array([d0 + 10, d0 + 500, d0 + 0, d0 + 3000]),
                        np.array([5, 50, 96, 1])))
    assert t.poll() is TransferStatus.PENDING  # 4 blocks in chunks of 3: one poll is not enough
    report = t.wait(5)
    assert t.status is TransferStatus.DONE and report.engine_calls == 2 and report.bytes == 152
    expect = np.zeros(4096, dtype=np.uint8)
    expect[10:15], expect[500:550], expect[0:96], expect[3000] = src[0:5], src[100:150], src[4000:4096], src[7]
    assert (dst == expect).all()


def test_refused_blocks_never_touch_memory() -> None:
    a, _, src, dst, peer = _pair()
    s0, d0 = src.ctypes.data, dst.ctypes.data
    with pytest.raises(BlockRangeError):
        a.write(peer, (np.array([s0, s0]), np.array([d0, d0 + 4090]), np.array([8, 8])))
    assert not dst.any() and a.batches_to_engine == 0
    with pytest.raises(UnknownPeer, match="not connected"):
        a.write("nobody", (np.array([s0]), np.array([d0]), np.array([1])))
    a.forget(peer)
    with pytest.raises(UnknownPeer):
        a.write(peer, (np.array([s0]), np.array([d0]), np.array([1])))


def test_lifecycle_is_enforced() -> None:
    e = create_engine(EngineConfig("local"))
    assert e.state is EngineState.NEW
    with pytest.raises(EngineStateError, match="needs started"):
        e.register([RegionRecord(4096, 10, "cpu")])
    e.start()
    with pytest.raises(EngineStateError):
        e.start()
    e.close()
    assert e.state is EngineState.CLOSED


def test_peer_info_wire_round_trip_and_checks() -> None:
    info = PeerInfo("nixl", "agent-1", Protocol.TCP, (RegionRecord(4096, 100, "cpu"),), (Granule(4096, 10, 10),),
                    b"\x00meta\xff")
    wire = info.to_wire()
    assert PeerInfo.from_wire(wire) == info
    for broken, match in (({**wire, "version": 2}, "version"), ({**wire, "kind": "x"}, "kind"),
                          ({**wire, "protocol": "carrier-pigeon"}, "malformed")):
        with pytest.raises(HandshakeError, match=match):
            PeerInfo.from_wire(broken)


def test_connect_refuses_another_backend_or_protocol() -> None:
    a, *_ = _pair()
    other = PeerInfo("nixl", "x", Protocol.TCP, (RegionRecord(4096, 1, "cpu"),))
    with pytest.raises(HandshakeError, match="backend"):
        a.connect(other)
    mine = a.local_info()
    with pytest.raises(HandshakeError, match="protocol"):
        a.connect(PeerInfo("local", mine.name, Protocol.RDMA, mine.regions))


def test_importing_the_package_imports_no_engine() -> None:
    code = ("import sys, pdfleet_runtime.engines as e\n"
            "[e.backend_capabilities(b) for b in ('local', 'mooncake', 'nixl', 'mori')]\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'nixl', 'nixl_cu12', 'nixl_cu13', 'mori')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_mori_declares_capabilities_and_fails_at_start_naming_its_library() -> None:
    caps = backend_capabilities("mori")
    assert caps.protocols == frozenset({Protocol.RDMA}) and not caps.publishes_layer_ids
    engine = create_engine(EngineConfig("mori", Protocol.RDMA))
    with pytest.raises(EngineUnavailable, match="libamdhip64") as info:
        engine.start()
    assert info.value.kind is FailureKind.UNAVAILABLE


def test_mooncake_failures_map_to_typed_errors() -> None:
    dead = map_write_failure("p:1", -1, -102, after_recovery=False)
    assert isinstance(dead, PeerUnreachable) and "-102" in str(dead)
    wedged = map_write_failure("p:1", -1, 0, after_recovery=True)
    assert isinstance(wedged, TransferFailed) and wedged.retryable and "after rebuilding" in str(wedged)


def test_nixl_exceptions_map_by_name() -> None:
    def exc(name: str) -> Exception:
        return type(name, (Exception,), {})("NIXL_ERR")

    assert isinstance(map_nixl_error("p", exc("nixlRemoteDisconnectError")), PeerUnreachable)
    nf = map_nixl_error("p", exc("nixlNotFoundError"))
    assert isinstance(nf, TransferFailed) and "no registration" in str(nf)
    assert isinstance(map_nixl_error("p", exc("nixlBackendError")), TransferFailed)
    assert memory_type("cpu") == ("DRAM", 0) and memory_type("cuda:3") == ("VRAM", 3)
