"""Two-process harness for the real engines over loopback.

The parent (pytest) spawns a target process (decode pools registered with the engine, seeded
background bytes) and an initiator process (prefill pools), both with the ``spawn`` context, as
daemons, and joins them with timeouts. The initiator runs named scenarios in order and sends back
one result dict per scenario; tests assert on those. Bytes are verified on the receiving side:
the target hashes its whole arena and the initiator compares that with the arena it expects
(background plus every block applied), so bytes outside the blocks must be untouched too.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdfleet_runtime.engines import EngineConfig, PeerInfo, TransferEngine, create_engine
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RankRegistration

LAYOUT = "qwen3.8-flash-next"
CAPACITY = (2, 1024)  # requests, tokens: 18 pages, so a request's pages are fragmented
TOKENS = 700
SCRATCH = 4 << 20  # a plain region after the pools, for raw 10,000-block batches
RESULT_TIMEOUT_S = 100.0


def _background(seed: int, n: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()


def _pools(shape_tp: int, seed: int) -> Any:
    import torch

    from pdfleet_runtime.layouts import PRESETS
    from pdfleet_runtime.pools import Capacity, RankPools
    from pdfleet_runtime.records import ParallelShape

    pools = RankPools(PRESETS[LAYOUT], ParallelShape(shape_tp), 0, 0, Capacity(*CAPACITY))
    pools.arena.copy_(torch.from_numpy(_background(seed, pools.arena.numel())))
    return pools


@dataclass
class _Memory:
    """One process's registered memory: pools arenas plus a scratch region, with numpy views."""

    pools: list[Any]
    scratch: np.ndarray

    def arrays(self) -> list[np.ndarray]:
        return [p.arena.numpy() for p in self.pools] + [self.scratch]

    def regions(self) -> list[Any]:
        from pdfleet_runtime.records import RegionRecord

        return [p.region for p in self.pools] + [RegionRecord(self.scratch.ctypes.data, self.scratch.size, "cpu")]

    def buffers(self) -> list[Any]:
        return [r for p in self.pools for r in p.records]

    def locate(self, addr: int) -> tuple[np.ndarray, int]:
        for arr in self.arrays():
            base = arr.ctypes.data
            if base <= addr < base + arr.size:
                return arr, addr - base
        raise ValueError(f"{addr:#x} is in no region")


def target_main(config: EngineConfig, conn: Connection, seed: int) -> None:
    """Decode side: register pools (tp 1) and a scratch region, publish info, answer digest requests."""
    engine = create_engine(config)
    engine.start()
    mem = _Memory([_pools(1, seed)], _background(seed + 1, SCRATCH))
    info = engine.register(mem.regions(), mem.buffers())
    conn.send({"info": info.to_wire(), "registration": mem.pools[0].registration(),
               "scratch": mem.scratch.ctypes.data})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            os._exit(0)
        if msg[0] == "digest":
            conn.send({a.ctypes.data: hashlib.sha256(a).hexdigest() for a in mem.arrays()})
        elif msg[0] == "cpu":
            conn.send(time.process_time())
        elif msg[0] == "exit":  # die abruptly: the dead-peer scenario
            conn.send("bye")
            os._exit(0)
        else:
            engine.close()
            conn.send("closed")
            return


@dataclass
class Ctx:
    """What a scenario gets: the started initiator engine, the connected peer and the target's state."""

    engine: TransferEngine
    peer: str
    mem: _Memory
    target: Connection
    target_reg: RankRegistration
    target_info: PeerInfo
    target_scratch: int
    expected: dict[int, np.ndarray]

    def apply(self, blocks: Blocks) -> None:
        """Record ``blocks`` in the expected target arenas (the oracle: what the receiver must hold)."""
        for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
            src, so = self.mem.locate(s)
            base = next(b for b, arr in self.expected.items() if b <= d < b + arr.size)
            self.expected[base][d - base : d - base + n] = src[so : so + n]

    def target_matches(self) -> bool:
        self.target.send(("digest",))
        got = self.target.recv()
        return got == {b: hashlib.sha256(a).hexdigest() for b, a in self.expected.items()}

    def scratch_blocks(self, n: int, size: int, seed: int) -> Blocks:
        """``n`` disjoint blocks of ``size`` bytes between the two scratch regions, shuffled."""
        rng = np.random.default_rng(seed)
        slots = SCRATCH // size
        src = rng.choice(slots, n, replace=False) * size + self.mem.scratch.ctypes.data
        dst = rng.choice(slots, n, replace=False) * size + self.target_scratch
        return Blocks(src, dst, np.full(n, size, dtype=np.int64))


def _report(r: Any) -> dict[str, Any]:
    return {k: getattr(r, k) for k in ("blocks", "bytes", "engine_calls", "engine_descriptors", "recoveries",
                                       "prepared_descriptors", "adhoc_descriptors", "seconds")}


def initiator_main(config: EngineConfig, target: Connection, out: Connection, scenarios: list[str],
                   seed: int) -> None:
    """Prefill side: pools of tp 1 and tp 2 plus scratch in one engine; run ``scenarios`` in order."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(RESULT_TIMEOUT_S - 10, exit=True, file=sys.stderr)  # stack, not a hang
    try:
        hello = target.recv()
        engine = create_engine(config)
        engine.start()
        mem = _Memory([_pools(1, seed + 7), _pools(2, seed + 8)], _background(seed + 9, SCRATCH))
        engine.register(mem.regions(), mem.buffers())
        info = PeerInfo.from_wire(hello["info"])
        peer = engine.connect(info)
        arena = hello["registration"].region
        expected = {arena.address: _background(seed, arena.total_bytes), hello["scratch"]: _background(seed + 1, SCRATCH)}
        ctx = Ctx(engine, peer, mem, target, hello["registration"], info, hello["scratch"], expected)
    except Exception:
        out.send({"setup": {"error": traceback.format_exc()}})
        return
    tr = engine.transport()
    results: dict[str, Any] = {"setup": {
        "ok": True, "effective": tr.effective, "pinned": tr.pinned,
        "environ": {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL", "MC_LOG_LEVEL",
                                                   "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER")},
    }}
    for name in scenarios:
        t0 = time.perf_counter()
        try:
            results[name] = SCENARIOS[name](ctx)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["elapsed_s"] = time.perf_counter() - t0
    out.send(results)
    engine.close()


def run_pair(config: EngineConfig, scenarios: list[str], seed: int = 3) -> dict[str, Any]:
    """Spawn target and initiator, run ``scenarios``, return their results (joins with timeouts)."""
    ctx = mp.get_context("spawn")
    i_target, t_for_init = ctx.Pipe()
    r_parent, r_child = ctx.Pipe(duplex=False)
    target = ctx.Process(target=target_main, args=(config, t_for_init, seed), daemon=True)
    init = ctx.Process(target=initiator_main, args=(config, i_target, r_child, scenarios, seed), daemon=True)
    target.start()
    init.start()
    for end in (t_for_init, i_target, r_child):  # only the children hold these: EOF means a child is gone
        end.close()
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while not r_parent.poll(0.2):
            if not init.is_alive() and not r_parent.poll(0.5):
                raise RuntimeError(f"initiator exited with code {init.exitcode} before sending results")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no results within {RESULT_TIMEOUT_S}s")
        return r_parent.recv()  # type: ignore[no-any-return]
    finally:
        for p in (init, target):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        r_parent.close()


# --------------------------------------------------------------------------- scenarios


def _planned(ctx: Ctx, pools_index: int) -> dict[str, Any]:
    from pdfleet_runtime.layouts import PRESETS
    from pdfleet_runtime.planner import compile_pair
    from pdfleet_runtime.pools import Capacity, RequestAllocator

    lay, cap = PRESETS[LAYOUT], Capacity(*CAPACITY)
    src_idx = RequestAllocator(lay, cap, seed=11).allocate(TOKENS)
    dst_idx = RequestAllocator(lay, cap, seed=12).allocate(TOKENS)
    plan = compile_pair(ctx.mem.pools[pools_index].registration(), ctx.target_reg)
    blocks = plan.plan(src_idx, dst_idx)
    report = ctx.engine.write(ctx.peer, blocks, timeout_s=60)
    ctx.apply(blocks)
    pages_fragmented = bool((np.diff(np.sort(dst_idx.pages)) != 1).any())
    return {"match": ctx.target_matches(), "fragmented": pages_fragmented, **_report(report)}


def planned_equal_tp(ctx: Ctx) -> dict[str, Any]:
    return _planned(ctx, 0)


def planned_hetero_tp(ctx: Ctx) -> dict[str, Any]:
    """Prefill tp 2 rank 0 -> decode tp 1: half-head blocks inside each destination page."""
    return _planned(ctx, 1)


def _refused(ctx: Ctx, bad: Blocks) -> dict[str, Any]:
    calls = ctx.engine.batches_to_engine
    try:
        ctx.engine.write(ctx.peer, bad, timeout_s=10)
        raised = None
    except Exception as e:
        raised = e
    return {
        "error_type": type(raised).__name__,
        "side": getattr(raised, "side", None),
        "count": getattr(raised, "count", None),
        "batches_to_engine_delta": ctx.engine.batches_to_engine - calls,
        "untouched": ctx.target_matches(),
    }


def out_of_range_local(ctx: Ctx) -> dict[str, Any]:
    """Block 5 of 8 reads 64 bytes past the end of the local scratch region."""
    good = ctx.scratch_blocks(8, 4096, seed=21)
    src = good.src.copy()
    src[5] = ctx.mem.scratch.ctypes.data + SCRATCH - 4096 + 64
    return _refused(ctx, Blocks(src, good.dst, good.length))


def out_of_range_remote(ctx: Ctx) -> dict[str, Any]:
    """Block 2 of 8 writes past the end of the target's scratch region."""
    good = ctx.scratch_blocks(8, 4096, seed=22)
    dst = good.dst.copy()
    dst[2] = ctx.target_scratch + SCRATCH - 100
    return _refused(ctx, Blocks(good.src, dst, good.length))


def _write_verified(ctx: Ctx, n: int, size: int, seed: int) -> dict[str, Any]:
    blocks = ctx.scratch_blocks(n, size, seed)
    report = ctx.engine.write(ctx.peer, blocks, timeout_s=60)
    ctx.apply(blocks)
    return {"match": ctx.target_matches(), **_report(report)}


def batch_10000(ctx: Ctx) -> dict[str, Any]:
    return {"queue_var": os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"),
            **_write_verified(ctx, 10_000, 256, seed=31)}


def raw_queue_full_then_write(ctx: Ctx) -> dict[str, Any]:
    """Overfill the peer's queue with the raw engine (5,000 entries), then send the same blocks through the
    adapter: whatever the raw batch left behind, the target must end up with every block."""
    blocks = ctx.scratch_blocks(5000, 256, seed=41)
    raw = ctx.engine.raw  # type: ignore[attr-defined]
    rc = raw.batch_transfer_sync_write(ctx.peer, blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist())
    report = ctx.engine.write(ctx.peer, blocks, timeout_s=60)
    ctx.apply(blocks)
    return {"raw_rc": int(rc), "match": ctx.target_matches(), **_report(report)}


def raw_out_of_range_then_write(ctx: Ctx) -> dict[str, Any]:
    """A write the engine itself must refuse (past the target's registration), then a good write."""
    src = ctx.mem.scratch.ctypes.data
    dst = ctx.target_scratch + SCRATCH - 8
    if ctx.engine.settings.backend == "mooncake":
        rc = int(ctx.engine.raw.transfer_sync_write(ctx.peer, src, dst, 64))  # type: ignore[attr-defined]
        injected = f"rc={rc}"
    else:
        agent = ctx.engine.raw  # type: ignore[attr-defined]
        try:
            h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(np.array([[src, 64, 0]], np.uint64), "DRAM"),
                                      agent.get_xfer_descs(np.array([[dst, 64, 0]], np.uint64), "DRAM"), ctx.peer)
            injected = f"created {agent.transfer(h)}"
        except Exception as e:
            injected = type(e).__name__
    return {"injected": injected, **_write_verified(ctx, 32, 8192, seed=51)}


def poisoned_then_write(ctx: Ctx) -> dict[str, Any]:
    """Mooncake: the engine looks wedged (every call fails) until the adapter rebuilds it."""
    from pdfleet_runtime.engines.mooncake import InjectedFault

    ctx.engine.inject_fault(InjectedFault.POISON)  # type: ignore[attr-defined]
    gen = ctx.engine.generation  # type: ignore[attr-defined]
    out = _write_verified(ctx, 16, 4096, seed=61)
    return {"generation_delta": ctx.engine.generation - gen, **out}  # type: ignore[attr-defined]


def idle_cpu(ctx: Ctx) -> dict[str, Any]:
    """CPU seconds each process spends over one idle second with its engine connected (a spinning
    progress thread costs most of a core)."""
    ctx.target.send(("cpu",))
    t0, i0, w0 = ctx.target.recv(), time.process_time(), time.perf_counter()
    time.sleep(1.0)
    ctx.target.send(("cpu",))
    t1, i1, w1 = ctx.target.recv(), time.process_time(), time.perf_counter()
    return {"initiator_cpu_s": i1 - i0, "target_cpu_s": t1 - t0, "wall_s": w1 - w0}


def empty_batch(ctx: Ctx) -> dict[str, Any]:
    """A batch of no blocks completes at once, with no engine request."""
    report = ctx.engine.write(ctx.peer, Blocks(*(np.zeros(0, np.int64),) * 3), timeout_s=5)
    return _report(report)


def dead_peer(ctx: Ctx) -> dict[str, Any]:
    """Kill the target, then write: a typed error, fast."""
    ctx.target.send(("exit",))
    ctx.target.recv()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait for the process to be gone (its end of the pipe closes)
        try:
            ctx.target.send(("digest",))
            ctx.target.recv()
        except (EOFError, OSError, BrokenPipeError):
            break
        time.sleep(0.05)
    blocks = ctx.scratch_blocks(16, 4096, seed=71)
    t0 = time.perf_counter()
    try:
        ctx.engine.write(ctx.peer, blocks, timeout_s=30)
        raised = None
    except Exception as e:
        raised = e
    return {"error_type": type(raised).__name__, "kind": getattr(raised, "kind", None),
            "seconds": time.perf_counter() - t0, "message": str(raised)}


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    f.__name__: f
    for f in (planned_equal_tp, planned_hetero_tp, out_of_range_local, out_of_range_remote, batch_10000,
              raw_queue_full_then_write, raw_out_of_range_then_write, poisoned_then_write, idle_cpu, empty_batch,
              dead_peer)
}
