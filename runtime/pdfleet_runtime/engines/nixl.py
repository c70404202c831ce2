"""NIXL adapter (UCX backend): descriptor lists prepared once, transfers addressed by index.

At ``register`` every item of every buffer (a granule: one page, slot or row) becomes one
descriptor of a local list prepared with ``prep_xfer_dlist``; at ``connect`` the peer's items
become a remote list. A write then only computes item indices (vectorized) and calls
``make_prepped_xfer``: no descriptor is rebuilt per request. Blocks that are not whole items on
both sides (heterogeneous-TP slices) cannot be addressed by index and go in one per-request list
(``initialize_xfer``); reports count both kinds.

Hazards handled: ``register_memory`` logs and passes ``None`` on a malformed list (checked); a
missing UCX plugin is skipped with a warning at agent creation (refused here); NIXL raises its own
exception classes, mapped by name to this package's errors (a disconnected peer becomes
``PeerUnreachable`` at once). NIXL cannot report the UCX transport it picked, so ``UCX_TLS`` is
pinned from the protocol (``settings``); with no protocol the transport is reported unpinned.
NIXL's Python wrapper gives the UCX progress thread a poll timeout of 0, so every idle agent spins
a core (and competes with transfers on small hosts): agents are made with a 1 ms timeout, the
thread still waking at once on worker events (``_new_agent``). A post that completes the transfer
itself (the default path between processes of one host copies in the kernel) is not polled again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from pdfleet_runtime.engines.base import (
    EngineCapabilities,
    PeerId,
    PeerInfo,
    PeerState,
    Transfer,
    TransferEngine,
    TransferReport,
    TransportReport,
    import_first,
)
from pdfleet_runtime.engines.blocks import GranuleTable
from pdfleet_runtime.engines.errors import (
    EngineError,
    EngineStartError,
    HandshakeError,
    PeerUnreachable,
    SettingsError,
    TransferFailed,
)
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord

__all__ = ["LIBRARY", "MODULES", "NixlEngine", "map_nixl_error", "memory_type"]

MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
"""GPU hosts (CUDA 13) carry ``nixl_cu13``, CPU hosts ``nixl_cu12``; the meta package ``nixl`` last."""
LIBRARY = "NIXL (pip nixl-cu12 on CPU hosts, nixl-cu13 on CUDA 13 hosts)"
_BACKEND = "UCX"
PROGRESS_THREAD_DELAY_US = 1000
"""Poll timeout of the UCX progress thread: it wakes on worker events and at least this often
(the periodic wake works around fds UCX fails to signal). NIXL's Python default, 0, busy-polls."""
T = TypeVar("T")
_AGENT_LOCK = threading.Lock()


def map_nixl_error(peer: str, exc: BaseException) -> EngineError:
    """A NIXL exception (matched by class name, so this works without importing NIXL) as our error."""
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        return PeerUnreachable(f"peer {peer} disconnected ({name})")
    if name == "nixlNotFoundError":
        return TransferFailed(f"NIXL found no registration for a block to or from {peer} ({name}): the "
                              "peer's published regions disagree with its engine")
    return TransferFailed(f"NIXL failed a transfer with {peer}: {name}: {exc}")


def memory_type(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a region's device (``cpu``, ``cuda``, ``cuda:N``)."""
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda"):
        _, _, idx = device.partition(":")
        return "VRAM", int(idx or 0)
    raise SettingsError(f"NIXL cannot register memory on device {device!r}")


def _new_agent(api: Any, name: str, delay_us: int | None = None) -> Any:
    """A UCX agent whose progress thread waits for events (``delay_us`` timeout) instead of spinning.

    ``nixl_agent`` hard-codes the progress thread's poll timeout (``pthrDelay``) to 0, so an idle
    agent spins a core (85% of one, measured on 1.5.1). The binding's config has the field, but
    the wrapper builds the config itself: the config is amended on its way to the binding's
    constructor, for this one call. Without that binding attribute the agent is made as is.
    The same amendment sets strict thread sync (the agent's own mutex around every call): without a
    listener thread the wrapper leaves sync off, and the prefill rank writes to several decodes from
    several threads at once.
    """
    bind = getattr(api, "nixlBind", None)
    if getattr(bind, "nixlAgent", None) is None:
        return api.nixl_agent(name, api.nixl_agent_config(backends=[_BACKEND]))

    real = bind.nixlAgent
    delay = PROGRESS_THREAD_DELAY_US if delay_us is None else delay_us

    def make(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay
        strict = getattr(bind, "NIXL_THREAD_SYNC_STRICT", None)
        if strict is not None:
            config.syncMode = strict
        return real(agent_name, config)

    with _AGENT_LOCK:  # the binding is module state: one amended construction at a time
        bind.nixlAgent = make
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=[_BACKEND]))
        finally:
            bind.nixlAgent = real


def _one_memory_type(regions: tuple[RegionRecord, ...], who: str) -> tuple[str, int]:
    kinds = {memory_type(r.device) for r in regions}
    if len(kinds) != 1:
        raise SettingsError(f"{who} regions must share one device, got {sorted(r.device for r in regions)}")
    return kinds.pop()


@dataclass
class _NixlPeer:
    name: str
    mem: str
    dlist: Any


class _NixlTransfer(Transfer):
    """Posted NIXL requests (one prepared, at most one per-request), polled until every one is DONE."""

    sleep_after_every_poll = True

    def __init__(self, engine: NixlEngine, peer: PeerId, batch: Blocks, prepared: int, adhoc: int) -> None:
        super().__init__(peer, batch)
        self._engine = engine
        self._handles: list[Any] = []
        self._pending: list[Any] = []
        self._prepared, self._adhoc = prepared, adhoc

    def _post(self, handle: Any) -> None:
        self._handles.append(handle)
        state = self._engine._guard(self.peer, self._engine.raw.transfer, handle)
        if state == "ERR":
            raise TransferFailed(f"NIXL refused to post a transfer to {self.peer}")
        if state != "DONE":  # done within the post (a kernel copy between processes): nothing to poll
            self._pending.append(handle)

    def _advance(self) -> TransferReport | None:
        if self._pending:
            check, guard = self._engine.raw.check_xfer_state, self._engine._guard
            for h in tuple(self._pending):
                state = guard(self.peer, check, h)
                if state == "DONE":
                    self._pending.remove(h)
                elif state == "ERR":
                    raise TransferFailed(f"NIXL transfer to {self.peer} reported ERR")
            if self._pending:
                return None
        calls = len(self._handles)
        self.cancel()
        b = self.batch
        return TransferReport(self.peer, b.descriptors, b.bytes, calls, self._prepared + self._adhoc,
                              time.perf_counter() - self.started, 0, self._prepared, self._adhoc)

    def cancel(self) -> None:
        handles, self._handles, self._pending = self._handles, [], []
        for h in handles:
            with contextlib.suppress(Exception):  # a handle NIXL cannot cancel is leaked, not fatal
                h.release()


class NixlEngine(TransferEngine):
    """NIXL with the UCX backend; one agent per adapter."""

    capabilities = EngineCapabilities(
        backend="nixl",
        protocols=frozenset({LinkProtocol.TCP, LinkProtocol.RDMA, LinkProtocol.NVLINK, LinkProtocol.SHM}),
        memory=frozenset({"cpu", "cuda"}),
        library=LIBRARY,
        prepared_descriptors=True,
    )

    def _start(self) -> None:
        api = import_first(MODULES, LIBRARY)
        self._agent_name = self.config.name or f"pdfleet-{self.config.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._agent = _new_agent(api, self._agent_name)
        except Exception as e:
            raise EngineStartError(f"NIXL agent creation failed: {type(e).__name__}: {e}") from e
        if _BACKEND not in self._agent.backends:
            raise EngineStartError(f"NIXL has no {_BACKEND} backend (plugins: {self._agent.get_plugin_list()})")
        self._local_dlist: Any = None
        self._mem = ("DRAM", 0)

    def _register(self, regions: tuple[RegionRecord, ...]) -> None:
        self._mem = _one_memory_type(regions, "local")
        mem, dev = self._mem
        descs = [(r.address, r.total_bytes, dev, "") for r in regions]
        try:
            if self._agent.register_memory(descs, mem) is None:
                raise EngineStartError("NIXL register_memory returned no descriptor list")
            if self._local_granules.size:
                self._local_dlist = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._local_granules.descriptors(dev), mem)
        except EngineError:
            raise
        except Exception as e:
            raise EngineStartError(f"NIXL registration failed: {type(e).__name__}: {e}") from e

    def _name(self) -> str:
        return self._agent_name

    def _metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _connect(self, info: PeerInfo) -> Any:
        mem, dev = _one_memory_type(info.regions, f"peer {info.name}")
        try:
            name = self._agent.add_remote_agent(info.metadata)
        except Exception as e:
            raise HandshakeError(f"NIXL refused the metadata of {info.name}: {type(e).__name__}: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != info.name:
            raise HandshakeError(f"peer published name {info.name} but its metadata names {name}")
        dlist = None
        if info.granules and self._local_dlist is not None:
            descs = GranuleTable(info.granules).descriptors(dev)
            dlist = self._guard(PeerId(name), self._agent.prep_xfer_dlist, name, descs, mem)
        return _NixlPeer(name, mem, dlist)

    def _forget(self, peer: PeerState) -> None:
        handle: _NixlPeer = peer.handle
        for step in (lambda: handle.dlist and handle.dlist.release(),
                     lambda: self._agent.remove_remote_agent(handle.name)):
            with contextlib.suppress(Exception):  # forgetting a peer that is already gone
                step()

    def _close(self) -> None:
        if self._local_dlist is not None:
            with contextlib.suppress(Exception):
                self._local_dlist.release()
        self._local_dlist = None

    def transport(self) -> TransportReport:
        """Pinned through ``UCX_TLS`` (NIXL cannot say which UCX transport it used); unpinned without a protocol."""
        s = self.settings
        tls = s.env.get("UCX_TLS") if s.pinned else None
        return TransportReport(s.protocol, s.engine_protocol, f"ucx:{tls}" if tls else "unpinned", s.pinned, s.env)

    @property
    def raw(self) -> Any:
        """The NIXL agent itself, for the benchmark's baseline and fault-injection tests: no checks."""
        return self._agent

    def _guard(self, peer: PeerId, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except EngineError:
            raise
        except Exception as e:
            raise map_nixl_error(peer, e) from e

    def _indices(self, peer: PeerState, batch: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Blocks addressable in the prepared lists (whole, equal-sized items on both sides): their mask
        and the local and remote item indices of those blocks, in order. None when no block is."""
        if self._local_dlist is None or peer.handle.dlist is None:
            return None
        lok, lfirst, litem = self._local_granules.locate(batch.src, batch.length)
        rok, rfirst, ritem = peer.granules.locate(batch.dst, batch.length)
        mask = lok & rok & (litem == ritem)
        if mask.all():
            items = batch.length // litem
        elif mask.any():
            lfirst, rfirst, items = lfirst[mask], rfirst[mask], batch.length[mask] // litem[mask]
        else:
            return None
        return mask, GranuleTable.expand(lfirst, items), GranuleTable.expand(rfirst, items)

    def _submit(self, peer_id: PeerId, peer: PeerState, batch: Blocks) -> Transfer:
        agent, remote = self._agent, peer.handle
        by_index = self._indices(peer, batch) if batch.descriptors else None
        if by_index is None:
            rest = batch if batch.descriptors else None
        else:
            rest = None if by_index[0].all() else batch.take(~by_index[0])
        prepared = 0 if by_index is None else int(by_index[1].size)
        transfer = _NixlTransfer(self, peer_id, batch, prepared, 0 if rest is None else rest.descriptors)
        handles: list[Any] = []
        try:  # every request is made before any is posted: a refused one leaves nothing written
            if by_index is not None:
                _, li, ri = by_index
                handles.append(self._guard(peer_id, agent.make_prepped_xfer, "WRITE", self._local_dlist, li,
                                           remote.dlist, ri))
            if rest is not None:
                dev_l, dev_r = self._mem[1], 0 if remote.mem == "DRAM" else _one_memory_type(
                    peer.info.regions, remote.name)[1]
                loc = np.stack([rest.src, rest.length, np.full(rest.descriptors, dev_l)], 1).astype(np.uint64)
                rem = np.stack([rest.dst, rest.length, np.full(rest.descriptors, dev_r)], 1).astype(np.uint64)
                handles.append(self._guard(peer_id, agent.initialize_xfer, "WRITE",
                                           agent.get_xfer_descs(loc, self._mem[0]),
                                           agent.get_xfer_descs(rem, remote.mem), remote.name))
            for h in handles:
                transfer._post(h)
        except BaseException:
            for h in handles:  # posted or not (a posted one is cancelled)
                with contextlib.suppress(Exception):
                    h.release()
            raise
        return transfer
