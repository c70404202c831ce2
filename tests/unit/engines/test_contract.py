"""The engine contract without real engines: the local engine, states, peer info, the lazy registry,
MORI's refusal and the mapping of engine failures to typed errors."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

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
    Transfer,
    TransferFailed,
    TransferReport,
    TransferStatus,
    TransferTimeout,
    UnknownPeer,
    adapter_class,
    base,
    create_engine,
    nixl,
)
from pdfleet_runtime.engines.base import PeerId
from pdfleet_runtime.engines.blocks import Granule
from pdfleet_runtime.engines.mooncake import map_write_failure
from pdfleet_runtime.engines.nixl import _new_agent, map_nixl_error, memory_type
from pdfleet_runtime.links import ENGINE_SETTINGS, UNSUPPORTED_PROTOCOLS, Backend, LinkProtocol
from pdfleet_runtime.matrix import LATEST_MATRIX_VERSION, MATRICES, Feature
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord


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
    t = a.submit(peer, Blocks(np.array([s0, s0 + 100, s0 + 4000, s0 + 7]),
                              np.array([d0 + 10, d0 + 500, d0 + 0, d0 + 3000]), np.array([5, 50, 96, 1])))
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
        a.write(peer, Blocks(np.array([s0, s0]), np.array([d0, d0 + 4090]), np.array([8, 8])))
    assert not dst.any() and a.batches_to_engine == 0
    with pytest.raises(UnknownPeer, match="not connected"):
        a.write("nobody", Blocks(np.array([s0]), np.array([d0]), np.array([1])))
    a.forget(peer)
    with pytest.raises(UnknownPeer):
        a.write(peer, Blocks(np.array([s0]), np.array([d0]), np.array([1])))


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
    info = PeerInfo("nixl", "agent-1", LinkProtocol.TCP, (RegionRecord(4096, 100, "cpu"),), (Granule(4096, 10, 10),),
                    b"\x00meta\xff")
    wire = info.to_wire()
    assert PeerInfo.from_wire(wire) == info
    for broken, match in (({**wire, "version": 2}, "version"), ({**wire, "kind": "x"}, "kind"),
                          ({**wire, "protocol": "carrier-pigeon"}, "malformed")):
        with pytest.raises(HandshakeError, match=match):
            PeerInfo.from_wire(broken)


def test_connect_refuses_another_backend_or_protocol() -> None:
    a, *_ = _pair()
    other = PeerInfo("nixl", "x", LinkProtocol.TCP, (RegionRecord(4096, 1, "cpu"),))
    with pytest.raises(HandshakeError, match="backend"):
        a.connect(other)
    mine = a.local_info()
    with pytest.raises(HandshakeError, match="protocol"):
        a.connect(PeerInfo("local", mine.name, LinkProtocol.RDMA, mine.regions))


def test_importing_the_package_imports_no_engine() -> None:
    code = ("import sys, pdfleet_runtime.engines as e\n"
            "[e.adapter_class(b).capabilities for b in ('local', 'mooncake', 'nixl', 'mori')]\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'nixl', 'nixl_cu12', 'nixl_cu13', 'mori')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_mori_declares_capabilities_and_fails_at_start_naming_its_library() -> None:
    caps = adapter_class("mori").capabilities
    assert caps.protocols == frozenset({LinkProtocol.RDMA}) and not caps.publishes_layer_ids
    engine = create_engine(EngineConfig("mori", LinkProtocol.RDMA))
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


class _Clock:
    """``time.monotonic`` and ``time.sleep`` for ``base``: a poll takes ``step`` s, sleeps are recorded."""

    def __init__(self, step: float = 1e-6) -> None:
        self.now, self.step, self.naps = 0.0, step, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.now += s


class _Steps(Transfer):
    """A transfer done after ``steps`` polls, each taking ``clock.step`` (a blocking engine call when long)."""

    def __init__(self, steps: int, clock: _Clock | None = None) -> None:
        super().__init__(PeerId("p"), Blocks(*(np.zeros(0, np.int64),) * 3))
        self.left, self.clock = steps, clock

    def _advance(self) -> TransferReport | None:
        if self.clock is not None:
            self.clock.now += self.clock.step
        self.left -= 1
        return TransferReport(self.peer, 0, 0, 1, 0, 0.0) if self.left <= 0 else None


def test_poll_interval_is_a_bounded_fraction_of_the_elapsed_time() -> None:
    assert base.poll_interval(0.0) == base.POLL_MIN_S
    assert base.poll_interval(0.032) == pytest.approx(0.032 * base.POLL_FRACTION)
    assert base.poll_interval(10.0) == base.POLL_MAX_S
    assert base.POLL_FRACTION <= 1 / 20  # a batch is seen done within 5% of its time


def test_wait_sleeps_between_quick_polls_but_not_after_a_blocking_one(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep,
                                                      perf_counter=time.perf_counter))
    quick = _Steps(200, clock)
    assert quick.wait(5).engine_calls == 1 and quick.status is TransferStatus.DONE
    assert len(clock.naps) == 199  # a sleep between every two polls
    assert clock.naps[0] == pytest.approx(base.POLL_MIN_S)  # backs off as the batch ages, up to the cap
    assert clock.naps[-1] == pytest.approx(base.POLL_MAX_S)
    assert all(b >= a - 1e-12 for a, b in zip(clock.naps, clock.naps[1:], strict=False))
    blocking = _Steps(4, _Clock(step=0.05))  # each poll waits 50 ms in the engine, longer than any interval
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=blocking.clock.monotonic, sleep=blocking.clock.sleep,
                                                      perf_counter=time.perf_counter))
    blocking.wait(5)
    assert blocking.clock.naps == []
    asking = _Asking(4, _Clock(step=0.05))  # NIXL: a slow status check is no wait, it still sleeps
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=asking.clock.monotonic, sleep=asking.clock.sleep,
                                                      perf_counter=time.perf_counter))
    asking.wait(5)
    assert len(asking.clock.naps) == 3


class _Asking(_Steps):
    sleep_after_every_poll = True


def test_wait_times_out_and_cancels() -> None:
    slow = _Steps(10**9)
    with pytest.raises(TransferTimeout):
        slow.wait(0.05)
    assert slow.status is TransferStatus.FAILED


class _FakeBind:
    NIXL_THREAD_SYNC_STRICT = "strict"

    def __init__(self) -> None:
        self.delays: list[int] = []
        self.sync: list[str] = []

    def nixlAgent(self, name: str, config: SimpleNamespace) -> str:
        self.delays.append(config.pthrDelay)
        self.sync.append(config.syncMode)
        return name


class _FakeNixlApi:
    """The shape of ``nixl._api``: ``nixl_agent`` builds its config with ``pthrDelay = 0`` and calls the binding."""

    def __init__(self) -> None:
        self.nixlBind = _FakeBind()

    def nixl_agent_config(self, backends: list[str]) -> list[str]:
        return backends

    def nixl_agent(self, name: str, backends: list[str]) -> str:
        return self.nixlBind.nixlAgent(name, SimpleNamespace(pthrDelay=0, syncMode="none"))


def test_nixl_agent_progress_thread_waits_instead_of_spinning() -> None:
    api = _FakeNixlApi()
    real = api.nixlBind.nixlAgent
    assert _new_agent(api, "a") == "a"
    assert api.nixlBind.delays == [nixl.PROGRESS_THREAD_DELAY_US] and nixl.PROGRESS_THREAD_DELAY_US >= 1000
    assert api.nixlBind.sync == ["strict"]  # the prefill rank writes to several decodes from several threads
    assert api.nixlBind.nixlAgent == real  # the binding is restored
    assert _new_agent(SimpleNamespace(nixl_agent=lambda n, c: n, nixl_agent_config=lambda backends: None), "b") == "b"


@pytest.mark.parametrize("backend", list(Backend))
def test_the_matrix_states_what_each_adapter_declares(backend: Backend) -> None:
    """The matrix (pure, no engine import) restates each adapter's declared capabilities: the two agree."""
    caps = adapter_class(backend).capabilities
    matrix = MATRICES[LATEST_MATRIX_VERSION]
    served = {p for (b, p) in ENGINE_SETTINGS if b is backend}
    assert caps.protocols == served, (backend, caps.protocols, served)
    assert not {p for (b, p) in UNSUPPORTED_PROTOCOLS if b is backend} & caps.protocols
    # Layer-id pairing of QSA across pipeline stages needs the handshake's per-buffer layer ids.
    assert matrix.supports(backend, Feature.QSA_PIPELINE).supported is caps.publishes_layer_ids
