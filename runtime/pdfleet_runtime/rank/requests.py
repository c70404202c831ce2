"""What a rank process does with a synthetic request, apart from its pipe: fill it (prefill), move and check it (decode).

``SyntheticSource`` is a prefill rank's ``synthetic`` callback: allocate the request's items, fill
them with seeded state, give them back on release; full pools fail the request ``BUSY``.
``DecodeRequests`` runs one ``TransferOp`` on a decode rank: allocate, ``DecodeRank.transfer`` with a
``SyntheticFill`` (one coordinator per prefill pod), verify every byte, free, and answer a
``TransferResult`` whose failure and cause are the protocol's own ``FailureReason``s. ``process``
drives both from the pipe; tests drive them in one process. For parity (``SeededArenaOp``) both
take a request's items from a reservation made in order, and a decode rank notes in its
``SeededArena`` what each request left in its items.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdfleet_runtime.engines.base import PeerInfo
from pdfleet_runtime.layouts import layout_digest, resolve_layout
from pdfleet_runtime.pools import PoolExhausted, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import Endpoint, StaticResolver
from pdfleet_runtime.protocol.keys import mounted_keys
from pdfleet_runtime.protocol.messages import PromptFill, SyntheticFill
from pdfleet_runtime.protocol.prefill import SyntheticError
from pdfleet_runtime.protocol.states import FailureReason, RequestState, StateTimeouts
from pdfleet_runtime.records import RequestIndices

from .arena import SeededArena
from .pipe import RankSpec, RankStats, TransferOp, TransferResult
from .synthetic import corrupt_request, fill_request, mismatched_buffers, request_bytes

if TYPE_CHECKING:
    from pdfleet_runtime.protocol.staged import DecodeStaging

__all__ = ["DecodeRequests", "SyntheticSource"]

log = logging.getLogger("pdfleet_runtime.server.rank")


class _Items:
    """The items a rank holds for requests in flight, by request id, and why each is held.

    Every held request is ``running`` (its coordinator has it), ``fencing`` (failed, waiting until no
    source can still write it) or ``orphaned`` (neither: a path that dropped it without a release).
    ``reconcile`` gives back what stayed orphaned past ``orphan_grace_s`` and counts it (``reclaimed``):
    no code path should leave one, and a leak must not cost the pod its pools for good.
    """

    def __init__(self, pools: RankPools, alloc: RequestAllocator, *, orphan_grace_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools, self.alloc = pools, alloc
        self.held: dict[str, RequestIndices] = {}
        self.reserved: dict[str, RequestIndices] = {}
        self.orphan_grace_s, self._clock = orphan_grace_s, clock
        self._orphan_since: dict[str, float] = {}
        self.reclaimed = 0
        """Orphaned requests whose items ``reconcile`` gave back (each a bug: logged)."""

    def reset(self, alloc: RequestAllocator, reserve: tuple[tuple[str, int], ...]) -> None:
        """A fresh allocator (no request may be held), then ``reserve``'s requests allocated in order."""
        if self.held:
            raise RuntimeError(f"{len(self.held)} requests are in flight on this rank")
        self.alloc = alloc
        self.reserved = {rid: alloc.allocate(tokens) for rid, tokens in reserve}

    def take(self, request_id: str, tokens: int) -> RequestIndices:
        """The request's items: its reservation, else newly allocated (``PoolExhausted`` when full).
        An id already held is refused (``ValueError``) before anything is allocated: its items would leak."""
        if request_id in self.held:
            raise ValueError(f"request {request_id} already holds items on this rank")
        idx = self.reserved.pop(request_id, None)
        self.held[request_id] = idx if idx is not None else self.alloc.allocate(tokens)
        return self.held[request_id]

    def release(self, request_id: str) -> None:
        idx = self.held.pop(request_id, None)
        self._orphan_since.pop(request_id, None)
        if idx is not None:
            self.alloc.free(idx)

    def free(self) -> dict[str, int]:
        return {k.value: v for k, v in self.alloc.free_counts().items()}

    def running(self) -> set[str]:
        """Held requests a coordinator has (subclasses say which)."""
        return set(self.held)

    def fencing(self) -> set[str]:
        return set()

    def held_by(self) -> dict[str, int]:
        """Held requests by why: running, fencing, orphaned (the ``pdfleet_pool_requests_held`` metric)."""
        running, fencing = self.running(), self.fencing()
        out = {"running": 0, "fencing": 0, "orphaned": 0}
        for rid in self.held:
            out["running" if rid in running else "fencing" if rid in fencing else "orphaned"] += 1
        return out

    def reconcile(self) -> list[str]:
        """Held items against the running requests: orphans past the grace are given back; their ids."""
        now, running, fencing = self._clock(), self.running(), self.fencing()
        orphans = [rid for rid in self.held if rid not in running and rid not in fencing]
        self._orphan_since = {rid: self._orphan_since.get(rid, now) for rid in orphans}
        gone = [rid for rid, since in self._orphan_since.items() if now - since >= self.orphan_grace_s]
        for rid in gone:
            log.error("request %s: items held with no request running or fencing for %.0fs; given back",
                      rid, now - self._orphan_since[rid])
            self.release(rid)
            self.reclaimed += 1
        return gone


class SyntheticSource(_Items):
    """A prefill rank's seeded request state (``PrefillRank(synthetic=source.fill, release=source.release)``).

    ``corrupt`` (``--fault-corrupt-sent``): flip one byte of each request's filled state before the engine
    writes it, so the wire really carries a wrong byte. ``fill_delay_s``: every fill sleeps first (the
    request's input is late: it waits for input meanwhile).
    """

    def __init__(self, pools: RankPools, alloc: RequestAllocator, *, corrupt: bool = False,
                 fill_delay_s: float = 0.0, orphan_grace_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(pools, alloc, orphan_grace_s=orphan_grace_s, clock=clock)
        self.corrupt, self.fill_delay_s = corrupt, fill_delay_s
        self.allocated: Callable[[str, RequestIndices], None] | None = None
        """Called with a request's items before its state is made (the staged path cuts its plans then)."""
        self.holding: Callable[[], set[str]] | None = None
        """The coordinator's requests that still hold items (``PrefillRank.holding``); None: all held run."""

    def running(self) -> set[str]:
        return set(self.held) if self.holding is None else self.holding()

    async def fill(self, request_id: str, fill: SyntheticFill | PromptFill) -> RequestIndices:
        if not isinstance(fill, SyntheticFill):
            raise SyntheticError(FailureReason.REFUSED, "a prompt request needs a prefill pod that computes a model "
                                 "(runtime config model); this one fills seeded state")
        try:
            idx = self.take(request_id, fill.tokens)
        except PoolExhausted as e:
            raise SyntheticError(FailureReason.BUSY, f"prefill pools are full: {e}") from None
        except ValueError as e:  # the id holds items already: refused, nothing allocated
            raise SyntheticError(FailureReason.CONFLICT, str(e)) from None
        if self.allocated is not None:
            self.allocated(request_id, idx)
        if self.fill_delay_s > 0:
            await asyncio.sleep(self.fill_delay_s)
        await asyncio.to_thread(fill_request, self.pools, fill.seed, idx)
        if self.corrupt:
            await asyncio.to_thread(corrupt_request, self.pools, idx)
        # _ready_at waits for the device: the engine reads on streams of its own.
        log.info("request %s: filled %d tokens of seeded state; state ready at %.6f", request_id, fill.tokens,
                 await asyncio.to_thread(_ready_at, self.pools))
        return idx

    def stats(self, in_flight: int) -> RankStats:
        return RankStats(in_flight, len(self.held), self.free(), held_by=self.held_by(), reclaimed=self.reclaimed)


def _ready_at(pools: RankPools) -> float:
    """``time.monotonic()`` once the device has finished writing the state (the benchmark's start)."""
    if pools.arena.is_cuda:
        import torch

        torch.cuda.synchronize(pools.arena.device)
    return time.monotonic()


class DecodeRequests(_Items):
    """A decode rank's synthetic requests: one ``DecodeRank`` per prefill pod, every byte checked."""

    def __init__(self, spec: RankSpec, pools: RankPools, alloc: RequestAllocator, info: PeerInfo, *,
                 staging: DecodeStaging | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        # An orphan is given back only after any write could have ended (the fence's own bound, and more).
        super().__init__(pools, alloc, orphan_grace_s=2 * max(spec.fence_timeout_s, spec.write_timeout_s + 5.0),
                         clock=clock)
        self.spec, self.info, self.staging = spec, info, staging
        self.coords: dict[Endpoint, DecodeRank] = {}
        self.in_flight = 0
        self._running: set[str] = set()
        self.arena: SeededArena | None = None
        """Set by ``SeededArenaOp`` (parity): what each request left in this rank's arena."""

    def release(self, request_id: str) -> None:
        """Give a failed request's items back (a succeeded one's go through ``_done``)."""
        idx = self.held.get(request_id)
        if idx is not None and self.arena is not None:
            self.arena.dirty(idx)
        self._free(request_id)

    def _done(self, request_id: str, seed: int) -> None:
        idx = self.held.get(request_id)
        if idx is not None and self.arena is not None:
            self.arena.wrote(idx, seed)
        self._free(request_id)

    def _free(self, request_id: str) -> None:
        """The request's items, and its staging lanes (both only once no source can still write them)."""
        super().release(request_id)
        if self.staging is not None:
            self.staging.release(request_id)

    def _coord(self, ep: Endpoint) -> DecodeRank:
        coord = self.coords.get(ep)
        if coord is None:
            spec = self.spec
            timeouts = StateTimeouts(bootstrapping_s=spec.request_timeout_s, transferring_s=spec.request_timeout_s)
            wire = {"wire": spec.faults.wire} if spec.faults.wire else {}
            coord = self.coords[ep] = DecodeRank(
                self.pools.registration(), self.info, StaticResolver([ep]),
                Codec(mounted_keys(spec.config.secret_path, spec.secret), f"{spec.instance}-{spec.tp}-{spec.pp}"),
                instance=spec.instance,
                settings=DecodeSettings(timeouts=timeouts, fence_timeout_s=spec.fence_timeout_s),
                release=self.release, staging=self.staging, model=spec.config.model_identity or "",
                layout=layout_digest(resolve_layout(spec.config.layout)), **wire)
        return coord

    async def transfer(self, op: TransferOp) -> TransferResult:
        """One synthetic request into this rank; the outcome, bytes, engine write time and the byte check."""
        request_id, seed = op.request_id, op.seed
        if request_id in self.held or any(c.tracks(request_id) for c in self.coords.values()):
            # Refused before anything is allocated: the id is in flight, fencing, or ended moments ago.
            return TransferResult(request_id, RequestState.FAILED, FailureReason.CONFLICT,
                                  reason=f"request id {request_id} is in flight or was used recently on this "
                                  "rank: send a new id")
        try:
            idx = self.take(request_id, op.tokens)
        except PoolExhausted as e:
            return TransferResult(request_id, RequestState.FAILED, FailureReason.BUSY,
                                  reason=f"decode pools are full: {e}")
        self.in_flight += 1
        self._running.add(request_id)
        fill = (PromptFill(prompt=op.prompt, expect=op.expect) if op.prompt
                else SyntheticFill(seed=seed, tokens=op.tokens))
        try:
            # From here the coordinator owns the items: it releases them (``release``) at once or after the
            # fence, on every path but a request it never took, whose items come back here.
            out = await self._coord(Endpoint(op.host, op.port)).transfer(
                request_id, idx, timeout_s=op.timeout_s, fill=fill,
                staged_bytes=request_bytes(self.pools, idx) if self.staging is not None else 0,
                wait_refused_s=op.wait_refused_s, kind=op.kind, room=op.room)
        except BaseException:
            # Only cancellation reaches here (the rank is stopping): nothing may still write into items
            # that go with the process, and a coordinator that never ran gives nothing back.
            self._running.discard(request_id)
            raise
        finally:
            self.in_flight -= 1
        if not out.accepted:
            self._free(request_id)
        moved = sum(r.bytes for r in out.reports)
        write_s = max((r.write_seconds for r in out.reports), default=0.0)
        mismatched, bad_buffers, share = -1, (), None
        if out.state is RequestState.SUCCESS and op.prompt:  # the model's state: its share goes to the gathering rank
            from pdfleet_runtime.rank.cache_pools import read_share

            share = await asyncio.to_thread(read_share, self.pools, idx)
            self._done(request_id, seed)
        elif out.state is RequestState.SUCCESS:
            if self.spec.faults.corrupt_received:
                await asyncio.to_thread(corrupt_request, self.pools, idx)
            bad = await asyncio.to_thread(mismatched_buffers, self.pools, seed, idx) if op.verify else {}
            mismatched, bad_buffers = sum(bad.values()), tuple(sorted(bad))
            self._done(request_id, seed)
        self._running.discard(request_id)
        log.info("request %s <- %s: %s%s, %d bytes (engine %.4fs, request %.4fs)%s%s", request_id, out.endpoint,
                 out.state.value, f" ({out.failure.value}: {out.reason})" if out.failure else "", moved, write_s,
                 out.seconds, f", {mismatched} bytes differ" if mismatched > 0 else "",
                 f"; {'staged' if out.staged else 'direct'}, landed at {out.landed_at:.6f}" if out.landed_at else "")
        # Released: no source can still write these items (the request was never accepted, or it ended), so
        # the pod may send the same request to another prefill pod.
        return TransferResult(request_id, out.state, out.failure, out.reason, moved, write_s, cause=out.cause,
                              seconds=out.seconds, mismatched=mismatched, released=request_id not in self.held,
                              mismatched_buffers=bad_buffers,
                              reports=tuple(out.reports) if out.state is RequestState.SUCCESS else (), share=share)

    def running(self) -> set[str]:
        return set(self._running)

    def fencing(self) -> set[str]:
        return set().union(*(c.fencing for c in self.coords.values()))

    def stats(self) -> RankStats:
        fenced: dict[str, int] = {}
        for c in self.coords.values():
            for k, v in c.fenced.items():
                fenced[k] = fenced.get(k, 0) + v
        return RankStats(self.in_flight, len(self.held), self.free(), fenced,
                         fences_pending=sum(c.fences_pending for c in self.coords.values()),
                         handshakes=sum(c.handshakes for c in self.coords.values()),
                         held_by=self.held_by(), reclaimed=self.reclaimed)

    async def close(self) -> None:
        for coord in self.coords.values():
            await coord.close()
