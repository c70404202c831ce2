"""Benchmark: one request GPU0 -> GPU1 across processes, through each path, against a plain peer copy.

    PYTHONPATH=runtime:operator python bench/gpu_transfer.py --engine mooncake|nixl \\
        [--tokens 4096 32768 131072] [--reps 5] [--modes peer raw adapter staged] [--out bench/results]

For ``qwen3.8-flash-next`` requests of each token count (prefill tp 1 -> decode tp 1, the runtime's
own layouts, pools and planner; pages drawn at random from pools with 25% spare, so fragmented;
arenas filled with seeded random bytes), a prefill process (pools on ``--gpus``' first GPU) writes
into a decode process (pools on the second). GB/s = request bytes / (time from the prefill's first
step for the request to the decode process seeing it complete), both read from CLOCK_MONOTONIC:

- ``peer``: a torch copy of the same number of bytes as one block, GPU0 -> GPU1 (in the prefill
  process; the link's ceiling);
- ``raw``: the engine itself, every block in one batch, descriptors built for the request
  (Mooncake ``batch_transfer_sync_write``; NIXL ``initialize_xfer``), then completion;
- ``adapter``: pdfleet's ``engine.write`` of the planner's blocks (checks, NIXL prepared lists,
  Mooncake's GPU fence);
- ``staged``: ``pdfleet_runtime.staging``: gather into a staging ring (Triton copy kernel), one
  engine write per chunk, scatter on the decode GPU after each chunk landed. One mode per
  ``--staged`` configuration; with ``p`` the prefill's plan is cut (on its GPU) before the request
  starts, as when the decode's indices arrive during the prefill's forward pass, and its cost is
  reported beside (``prepare``, and GB/s with it added); without ``p`` it is cut inside the timed
  window. The decode's scatter plan is always made when it sends its indices.

Completion is signalled through shared-memory counters (microseconds), so the figures are the
transfer path, not the HTTP status path of the protocol (parity covers that). After every mode the
decode arena is compared byte for byte with the expected arena (background plus every block) and
reset. Writes JSON (with the command, date and machine) to ``--out``; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

LAYOUT = "qwen3.8-flash-next"
MODES = ("peer", "raw", "adapter", "staged")
"""``kernels`` (gather and scatter alone, one GPU) may be added."""
SPARE = 1.25
"""Pool capacity over request tokens: random pages out of 25% more than needed are fragmented."""
_LANDED, _FREED, _DONE = 0, 1, 2
TIMEOUT_S = 120.0


class Counters:
    """``staging.Signals`` over a shared ``RawArray`` (one host; aligned int64 reads/writes are atomic)."""

    def __init__(self, arr: Any) -> None:
        self.arr = arr

    def landed(self) -> int:
        return int(self.arr[_LANDED])

    def set_landed(self, n: int) -> None:
        self.arr[_LANDED] = n

    def freed(self) -> int:
        return int(self.arr[_FREED])

    def set_freed(self, n: int) -> None:
        self.arr[_FREED] = n

    def wait(self, index: int, value: int, timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.arr[index] < value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"counter {index} stayed at {self.arr[index]} < {value}")
            time.sleep(0)


def _setup(device: str) -> Any:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    return torch


def _engine_config(args: argparse.Namespace, role: str) -> Any:
    from pdfleet_runtime.engines import EngineConfig
    from pdfleet_runtime.links import LinkProtocol

    env: dict[str, str | None] = {}
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    return EngineConfig(args.engine, LinkProtocol(args.protocol), env=env, name=f"bench-{role}-{os.getpid()}")


def _pools(tokens: int, device: str, seed: int) -> Any:
    import torch

    from pdfleet_runtime.layouts import PRESETS
    from pdfleet_runtime.pools import Capacity, RankPools
    from pdfleet_runtime.records import ParallelShape

    pools = RankPools(PRESETS[LAYOUT], ParallelShape(1), 0, 0, Capacity(1, int(tokens * SPARE)), device)
    _fill(pools.arena, seed, torch)
    return pools


def _fill(arena: Any, seed: int, torch: Any) -> None:
    """Seeded random bytes, the same in any process on the same kind of device."""
    gen = torch.Generator(device=arena.device).manual_seed(seed)
    arena.view(torch.int64).random_(generator=gen)


def _plan(tokens: int, src_reg: Any, dst_reg: Any) -> Any:
    from pdfleet_runtime.layouts import PRESETS
    from pdfleet_runtime.planner import compile_pair
    from pdfleet_runtime.pools import Capacity, RequestAllocator

    lay, cap = PRESETS[LAYOUT], Capacity(1, int(tokens * SPARE))
    return compile_pair(src_reg, dst_reg).plan(RequestAllocator(lay, cap, seed=5).allocate(tokens),
                                               RequestAllocator(lay, cap, seed=6).allocate(tokens))


# --------------------------------------------------------------------------- decode (target)


def _decode(conn: Connection, counters_arr: Any, args: argparse.Namespace, device: str) -> None:
    try:
        _decode_body(conn, Counters(counters_arr), args, device)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        raise


def _decode_body(conn: Connection, sig: Counters, args: argparse.Namespace, device: str) -> None:
    torch = _setup(device)
    from pdfleet_runtime import staging
    from pdfleet_runtime.engines import create_engine
    from pdfleet_runtime.records import RegionRecord

    pools = {t: _pools(t, device, 1000 + t) for t in args.tokens}
    ring = staging.StagingRing(1, _ring_bytes(args), device)
    background = {t: p.arena.clone() for t, p in pools.items()}
    engine = create_engine(_engine_config(args, "decode"))
    engine.start()
    regs = {t: p.registration() for t, p in pools.items()}
    ring_region = RegionRecord(ring.buffer.data_ptr(), ring.buffer.numel(), str(ring.buffer.device))
    info = engine.register([*(r.region for r in regs.values()), ring_region], [b for r in regs.values() for b in r.buffers])
    conn.send({"info": info.to_wire(), "registrations": regs, "ring": ring.buffer.data_ptr()})
    chunks_seen = 0
    expected: dict[int, Any] = {}
    plan: Any = None
    while True:
        cmd = conn.recv()
        op = cmd["op"]
        if op == "exit":
            break
        t = cmd.get("tokens")
        if op == "blocks":  # the request's blocks (what the decode's indices made the prefill plan)
            expected[t] = _expected(torch, background[t], pools, t, cmd["src"], cmd["dst"], cmd["length"], device)
            conn.send({"ok": True})
        elif op == "arm":
            staged = cmd["mode"].startswith("staged")
            if staged:
                cut = ring.reshaped(cmd["slots"], cmd["chunk"])
                plan = staging.StagePlan.build(cmd["dst"], cmd["length"], _chunk_bytes(cmd, int(cmd["length"].sum())),
                                               cmd["piece"], device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send({"armed": True})
            trace: list[tuple[int, str, float]] = []
            if staged:
                staging.receive(plan, pools[t].arena, cut, sig, chunks_seen, timeout_s=TIMEOUT_S, trace=trace)
                chunks_seen += len(plan.chunks)
            else:
                sig.wait(_DONE, cmd["seq"])
            conn.send({"t1": time.perf_counter(), "trace": trace})
        elif op == "verify":
            arena = pools[t].arena
            bad = int((arena != expected[t]).sum().item())
            first = int(torch.nonzero(arena != expected[t])[0].item()) if bad else None
            arena.copy_(background[t])  # the next mode must write every byte again
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send({"mismatched_bytes": bad, "first_mismatch_offset": first})
    engine.close()


def _expected(torch: Any, background: Any, pools: dict[int, Any], t: int, src: np.ndarray, dst: np.ndarray,
              length: np.ndarray, device: str) -> Any:
    """Background with every block copied from the prefill's seeded arena (regenerated here, on the host:
    an independent per-block loop, not the staging code under test)."""
    from pdfleet_runtime.layouts import PRESETS
    from pdfleet_runtime.pools import Capacity, RankPools
    from pdfleet_runtime.records import ParallelShape

    like = RankPools(PRESETS[LAYOUT], ParallelShape(1), 0, 0, Capacity(1, int(t * SPARE)), device)
    _fill(like.arena, 2000 + t, torch)
    source = like.arena.cpu().numpy()
    del like
    exp = background.cpu().numpy().copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        exp[d : d + n] = source[s : s + n]
    return torch.from_numpy(exp).to(device)


# --------------------------------------------------------------------------- prefill (initiator)


def _prefill(conn: Connection, counters_arr: Any, args: argparse.Namespace, device: str, peer_device: str) -> None:
    try:
        _prefill_body(conn, Counters(counters_arr), args, device, peer_device)
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        raise


def _prefill_body(conn: Connection, sig: Counters, args: argparse.Namespace, device: str, peer_device: str) -> None:
    torch = _setup(device)
    from pdfleet_runtime import staging
    from pdfleet_runtime.engines import PeerInfo, create_engine
    from pdfleet_runtime.engines import cuda as cuda_facts
    from pdfleet_runtime.engines.chunks import chunk_link
    from pdfleet_runtime.planner import Blocks
    from pdfleet_runtime.records import RegionRecord

    hello = conn.recv()
    pools = {t: _pools(t, device, 2000 + t) for t in args.tokens}
    ring = staging.StagingRing(1, _ring_bytes(args), device)
    engine = create_engine(_engine_config(args, "prefill"))
    engine.start()
    regs = {t: p.registration() for t, p in pools.items()}
    ring_region = RegionRecord(ring.buffer.data_ptr(), ring.buffer.numel(), str(ring.buffer.device))
    engine.register([*(r.region for r in regs.values()), ring_region], [b for r in regs.values() for b in r.buffers])
    peer_info = PeerInfo.from_wire(hello["info"])
    peer = engine.connect(peer_info)
    remote_ring = hello["ring"]
    blocks = {t: _plan(t, regs[t], hello["registrations"][t]) for t in args.tokens}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    conn.send({
        "blocks": {t: {"src": b.src - regs[t].region.address, "dst": b.dst - hello["registrations"][t].region.address,
                       "length": b.length, "descriptors": b.descriptors, "bytes": b.bytes,
                       "bytes_by_state": b.bytes_by_state()} for t, b in blocks.items()},
        "transport": engine.transport().effective,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
    })
    gpu = device if device.startswith("cuda") else None
    rdev = cuda_facts.device_index(peer_device) if peer_device.startswith("cuda") else 0
    ldev = cuda_facts.device_index(device) if gpu else 0
    mem = "VRAM" if gpu else "DRAM"
    raw = engine.raw
    seq = chunks_sent = 0

    def fence() -> None:
        if gpu:
            torch.cuda.synchronize()

    def raw_write(b: Any) -> None:
        if args.engine == "mooncake":
            rc = raw.batch_transfer_sync_write(peer, b.src.tolist(), b.dst.tolist(), b.length.tolist())
            if rc != 0:
                raise RuntimeError(f"raw mooncake batch returned {rc}")
            fence()  # the nvlink_intra copies are queued, not done, when the call returns
            return
        n = b.descriptors
        loc = np.stack([b.src, b.length, np.full(n, ldev)], 1).astype(np.uint64)
        rem = np.stack([b.dst, b.length, np.full(n, rdev)], 1).astype(np.uint64)
        h = raw.initialize_xfer("WRITE", raw.get_xfer_descs(loc, mem), raw.get_xfer_descs(rem, mem), peer)
        state = raw.transfer(h)
        while state not in ("DONE", "ERR"):
            state = raw.check_xfer_state(h)
        raw.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {state}")

    cuts = [ring]
    threaded, prepped = [False], [False]
    link = chunk_link(engine, peer)  # the staged path's engine glue, as serving uses it (engines/chunks.py)

    traces: list[list[tuple[int, str, float]]] = [[]]  # the current staged request's trace

    def mooncake_write(k: int, address: int, dst: int, nbytes: int) -> Any:
        traces[0].append((k, "write", time.perf_counter()))
        rc = raw.transfer_sync_write(peer, address, dst, nbytes)
        traces[0].append((k, "written", time.perf_counter()))
        if rc != 0:
            raise RuntimeError(f"mooncake chunk write returned {rc}")
        return staging.Marker(torch.cuda.default_stream() if gpu else None)  # after the queued copy

    def post(k: int, address: int, nbytes: int) -> Any:
        dst = remote_ring + (k % cuts[0].slots) * cuts[0].slot_bytes
        if args.engine == "mooncake":
            if threaded[0]:  # the runtime's chunk link: blocking writes in order on a GPU-bound thread
                return link.post(address, dst, nbytes)
            return mooncake_write(k, address, dst, nbytes).done
        if prepped[0]:  # the runtime's chunk link: prepared slot lists on both sides
            link.ring(cuts[0].address(0), remote_ring, cuts[0].slots, cuts[0].slot_bytes)
            return link.post(address, dst, nbytes)
        else:
            loc = np.array([[address, nbytes, ldev]], dtype=np.uint64)
            rem = np.array([[dst, nbytes, rdev]], dtype=np.uint64)
            h = raw.initialize_xfer("WRITE", raw.get_xfer_descs(loc, mem), raw.get_xfer_descs(rem, mem), peer)
        if raw.transfer(h) == "ERR":
            raise RuntimeError("NIXL refused a chunk")

        def done() -> bool:
            state = raw.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("NIXL chunk transfer failed")
            if state == "DONE":
                raw.release_xfer_handle(h)
                return True
            return False
        return done

    peer_dst = torch.empty(max(b.bytes for b in blocks.values()), dtype=torch.uint8, device=peer_device)
    while True:
        cmd = conn.recv()
        if cmd["op"] == "exit":
            break
        t, mode = cmd["tokens"], cmd["mode"]
        b = blocks[t]
        arena = pools[t].arena
        info: dict[str, Any] = {}
        if mode == "peer":
            src = arena[: b.bytes] if arena.numel() >= b.bytes else arena
            fence()
            t0 = time.perf_counter()
            peer_dst[: src.numel()].copy_(src)
            if gpu:
                torch.cuda.synchronize(arena.device)
                torch.cuda.synchronize(peer_dst.device)
            conn.send({"t0": t0, "t1": time.perf_counter()})
            continue
        seq += mode in ("raw", "adapter")
        prepared: Any = None
        if mode.startswith("staged") and cmd["prepared"]:  # built when the decode's indices arrived
            tp = time.perf_counter()
            prepared = staging.StagePlan.build(b.src - regs[t].region.address, b.length, _chunk_bytes(cmd, b.bytes),
                                               cmd["piece"], device)
            fence()
            info["prepare_ms"] = (time.perf_counter() - tp) * 1e3
        t0 = time.perf_counter()
        if mode == "raw":
            raw_write(Blocks(b.src, b.dst, b.length))
        elif mode == "adapter":
            rep = engine.write(peer, b, timeout_s=TIMEOUT_S)
            info = {"engine_calls": rep.engine_calls, "prepared": rep.prepared_descriptors,
                    "adhoc": rep.adhoc_descriptors}
        elif mode.startswith("staged"):
            cut = ring.reshaped(cmd["slots"], cmd["chunk"])
            cuts[0] = cut
            threaded[0], prepped[0] = bool(cmd["threaded"]), bool(cmd["slot_lists"])
            trace: list[tuple[int, str, float]] = []
            traces[0] = trace
            plan = prepared or staging.StagePlan.build(b.src - regs[t].region.address, b.length,
                                                       _chunk_bytes(cmd, b.bytes), cmd["piece"], device)
            ordered = torch.cuda.default_stream() if gpu and cmd["ordered"] and args.engine == "mooncake" else None
            staging.send(plan, arena, cut, post, sig, chunks_sent, timeout_s=TIMEOUT_S, engine_stream=ordered,
                         trace=trace)
            chunks_sent += len(plan.chunks)
            info |= {"chunks": len(plan.chunks), "chunk_bytes": plan.chunk_bytes, "pieces": len(plan.table),
                    "unit": plan.unit, "trace": trace}
        elif mode == "kernels":
            info = _kernels(torch, staging, b, regs[t].region.address, arena, ring, gpu)
        if mode in ("raw", "adapter"):
            sig.arr[_DONE] = seq
        conn.send({"t0": t0, "seq": seq, **info})
    link.close()
    engine.close()


def _ring_bytes(args: argparse.Namespace) -> int:
    return max(c["slots"] * c["chunk"] for c in args.staged)


KERNEL_VARIANTS = ((64, 16, 4), (64, 32, 8), (32, 16, 4), (128, 16, 4), (64, 8, 4))
"""(piece KiB, sub-block KiB, warps) that ``kernels`` times; the first is the default."""


def _kernels(torch: Any, staging: Any, b: Any, src_base: int, arena: Any, ring: Any,
             gpu: str | None) -> dict[str, Any]:
    """Gather and scatter alone on this GPU (chunks of up to 128 MiB, one stream), per kernel variant:
    the staging path's kernels against the link. The scatter writes the gathered bytes back where they
    came from (timed as gather + scatter less gather). GB/s count request bytes once (each kernel reads
    and writes them)."""
    chunk = min(128 << 20, ring.buffer.numel() // 256 * 256)
    slot = ring.buffer[:chunk]
    out: dict[str, Any] = {}
    defaults = staging.SUB_BYTES, staging.WARPS
    try:
        for piece, sub, warps in KERNEL_VARIANTS:
            staging.SUB_BYTES, staging.WARPS = sub << 10, warps
            plan = staging.StagePlan.build(b.src - src_base, b.length, chunk, piece << 10, arena.device)
            best = {"gather": float("inf"), "both": float("inf")}
            for name in ("gather", "both"):
                for _ in range(4):  # the first compiles
                    if gpu:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for k in range(len(plan.chunks)):
                        staging.gather_chunk(plan, k, arena, slot)
                        if name == "both":  # the same bytes back in place: the arena stays as it was
                            staging.scatter_chunk(plan, k, slot, arena)
                    if gpu:
                        torch.cuda.synchronize()
                    best[name] = min(best[name], time.perf_counter() - t0)
            out[f"{piece}k/{sub}k/w{warps}"] = {
                "gather_gbps": plan.bytes / best["gather"] / 1e9,
                "scatter_gbps": plan.bytes / max(best["both"] - best["gather"], 1e-9) / 1e9}
    finally:
        staging.SUB_BYTES, staging.WARPS = defaults
    return out


# --------------------------------------------------------------------------- parent


def _recv(conn: Connection, who: str, timeout_s: float = 600.0) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who} did not answer in {timeout_s:.0f}s")
    msg = conn.recv()
    if "error" in msg:
        raise RuntimeError(f"{who} failed:\n{msg['error']}")
    return msg  # type: ignore[no-any-return]


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    counters = ctx.RawArray(ctypes.c_int64, 8)
    dev_p, dev_d = args.devices
    d_conn, d_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    dec = ctx.Process(target=_decode, args=(d_child, counters, args, dev_d), daemon=True, name="decode")
    pre = ctx.Process(target=_prefill, args=(p_child, counters, args, dev_p, dev_d), daemon=True, name="prefill")
    dec.start()
    pre.start()
    out: dict[str, Any] = {"sizes": []}
    try:
        hello = _recv(d_conn, "decode")
        p_conn.send(hello)
        ready = _recv(p_conn, "prefill")
        out["transport"], out["device_name"] = ready["transport"], ready["device_name"]
        for t in args.tokens:
            bl = ready["blocks"][t]
            d_conn.send({"op": "blocks", "tokens": t, "src": bl["src"], "dst": bl["dst"], "length": bl["length"]})
            _recv(d_conn, "decode")
            size: dict[str, Any] = {"tokens": t, "bytes": bl["bytes"], "descriptors": bl["descriptors"],
                                    "bytes_by_state": bl["bytes_by_state"], "modes": {}}
            for mode in _expand(args):
                times, infos, traces = [], [], []
                cfg = next((c for c in args.staged if c["name"] == mode), None)
                for rep in range(args.reps + 1):  # the first is a warm-up (connections, IPC mappings)
                    go = {"op": "go", "tokens": t, "mode": mode, **(cfg or {})}
                    if mode in ("peer", "kernels"):
                        p_conn.send(go)
                        r = _recv(p_conn, "prefill")
                        dt = r.get("t1", 0.0) - r["t0"]
                        infos.append({k: v for k, v in r.items() if k not in ("t0", "t1", "seq")})
                    else:
                        arm: dict[str, Any] = {"op": "arm", "tokens": t, "mode": mode, **(cfg or {})}
                        if cfg is not None:
                            arm.update(src=bl["src"], dst=bl["dst"], length=bl["length"])
                        else:
                            arm["seq"] = _next_seq(out)
                        d_conn.send(arm)
                        _recv(d_conn, "decode")
                        p_conn.send(go)
                        r = _recv(p_conn, "prefill")
                        d = _recv(d_conn, "decode")
                        dt = d["t1"] - r["t0"]
                        infos.append({k: v for k, v in r.items() if k not in ("t0", "seq", "trace")})
                        traces.append(_timeline(r["t0"], r.get("trace", []), d.get("trace", []), d["t1"]))
                    if rep:
                        times.append(dt)
                if mode == "kernels":
                    size["kernels"] = infos[-1]
                    print(f"  {t:>6} tokens kernels (one GPU, 128 MiB chunks; piece/sub/warps: gather, scatter GB/s) "
                          + ", ".join(f"{v} {r['gather_gbps']:.0f} {r['scatter_gbps']:.0f}" for v, r in infos[-1].items()),
                          flush=True)
                    continue
                entry: dict[str, Any] = {"seconds": times, "median_s": statistics.median(times),
                                         "min_s": min(times), "gbps": bl["bytes"] / statistics.median(times) / 1e9}
                if infos:
                    entry["info"] = infos[-1]
                if cfg is not None:  # each step's median over the timed repetitions
                    entry["timeline_ms"] = {k: statistics.median(tr[k] for tr in traces[1:]) for k in traces[-1]}
                    if "prepare_ms" in infos[-1]:
                        prep = statistics.median(i["prepare_ms"] for i in infos[1:])
                        entry["timeline_ms"]["prepare"] = prep
                        entry["gbps_with_prepare"] = bl["bytes"] / (statistics.median(times) + prep / 1e3) / 1e9
                if mode != "peer":
                    d_conn.send({"op": "verify", "tokens": t})
                    entry.update(_recv(d_conn, "decode"))
                size["modes"][mode] = entry
                tl = entry.get("timeline_ms", {})
                print(f"  {t:>6} tokens {mode:13s} {entry['gbps']:8.1f} GB/s  median {entry['median_s'] * 1e3:8.3f} ms"
                      + (f" ({entry['gbps_with_prepare']:.1f} GB/s with the plan)" if "gbps_with_prepare" in entry else "")
                      + (f"  mismatched {entry['mismatched_bytes']}" if mode != "peer" else "")
                      + (f"  [{', '.join(f'{k} {v:.2f}' for k, v in tl.items())}]" if tl else ""), flush=True)
            out["sizes"].append(size)
    finally:
        for c in (d_conn, p_conn):
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send({"op": "exit"})
        for p in (pre, dec):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    return out


def _expand(args: argparse.Namespace) -> list[str]:
    """``staged`` becomes one mode per staging configuration."""
    return [m for mode in args.modes for m in ([c["name"] for c in args.staged] if mode == "staged" else [mode])]


def _staged_configs(specs: list[str], engine: str, piece_kib: int) -> list[dict[str, Any]]:
    """``128x3`` = 3 slots of 128 MiB, chunks of the slot size, the engine posted after the host saw the
    gather end; ``o``: the engine's stream waits for the gather on the device and the chunk is posted at
    once (Mooncake only); ``t``: Mooncake's blocking writes run on a worker thread (the runtime's chunk link);
    ``d``: NIXL posts chunks through prepared slot lists (``make_prepped_xfer``; NIXL only); ``t`` and ``d`` are
    the runtime's own chunk links (``engines/chunks.py``, what serving uses);
    ``p``: the prefill's plan is built and on the GPU before the request starts, as when the decode's
    indices arrive during the prefill's forward pass (its cost is reported as ``prepare_ms``; without
    ``p`` the plan is built lazily inside the timed window); ``aN``: chunks of
    ``staging.chunk_size(request, slot, N)`` (a small request still splits into about N chunks).
    Configurations with another engine's flags are dropped (NIXL's posts are asynchronous already)."""
    out = []
    for spec in specs:
        m = re.fullmatch(r"(\d+)x(\d+)(o?)(t?)(d?)(p?)(?:a(\d+))?", spec)
        if m is None:
            raise SystemExit(f"bad --staged spec {spec!r} (MiBxSLOTS[o][t][d][p][aN])")
        ordered, threaded, lists = bool(m.group(3)), bool(m.group(4)), bool(m.group(5))
        if ((ordered or threaded) and engine != "mooncake") or (lists and engine != "nixl"):
            continue
        out.append({"name": f"staged-{spec}", "chunk": int(m.group(1)) << 20, "slots": int(m.group(2)),
                    "ordered": ordered, "threaded": threaded, "slot_lists": lists, "prepared": bool(m.group(6)),
                    "min_chunks": int(m.group(7)) if m.group(7) else 0, "piece": piece_kib << 10})
    return out


def _chunk_bytes(cfg: dict[str, Any], total: int) -> int:
    """The chunk both sides cut a request of ``total`` bytes into (the same function on both)."""
    from pdfleet_runtime import staging

    return staging.chunk_size(total, cfg["chunk"], cfg["min_chunks"]) if cfg["min_chunks"] else int(cfg["chunk"])


def _timeline(t0: float, sent: list[tuple[int, str, float]], got: list[tuple[int, str, float]],
              t1: float) -> dict[str, float]:
    """Milliseconds from the request's start: plan made (first gather), first and last chunk landed,
    first scatter, and the end; plus the mean time one engine post took."""
    def first(trace: list[tuple[int, str, float]], step: str, last: bool = False) -> float:
        times = [x for _, st, x in trace if st == step]
        return ((max(times) if last else min(times)) - t0) * 1e3 if times else float("nan")

    posts = [b - a for (_, sa, a), (_, sb, b) in itertools.pairwise(sent) if sa == "post" and sb == "posted"]
    out = {"plan": first(sent, "gather"), "landed0": first(sent, "landed"), "landed_last": first(sent, "landed", True),
           "scatter0": first(got, "scatter"), "end": (t1 - t0) * 1e3,
           "post_ms": 1e3 * statistics.mean(posts) if posts else float("nan")}
    if any(st == "write" for _, st, _ in sent):  # Mooncake: its blocking write, first and last chunk
        out |= {"write0": first(sent, "write"), "written0": first(sent, "written"),
                "written_last": first(sent, "written", True)}
    return out


def _next_seq(out: dict[str, Any]) -> int:
    out["_seq"] = out.get("_seq", 0) + 1
    return int(out["_seq"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=("mooncake", "nixl"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=(*MODES, "kernels"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpus", default="0,1", help="prefill GPU, decode GPU (default 0,1)")
    parser.add_argument("--protocol", default=None, help="default nvlink on cuda, tcp on cpu")
    parser.add_argument("--ucx-tls", default=None, help="override the protocol table's UCX_TLS (NIXL)")
    parser.add_argument("--staged", nargs="+", default=["128x3op", "256x3tp", "128x3dp", "256x3dpa4", "256x3t", "128x3d"],
                        help="staging configurations MiBxSLOTS[o][t][d][p][aN] (o: stream-ordered posting and t: "
                             "a posting thread, Mooncake; d: prepared slot lists, NIXL; p: plan made before the "
                             "request; aN: a request splits into at least about N chunks); configurations with "
                             "the other engine's flags are skipped")
    parser.add_argument("--piece", type=int, default=64, help="staging: most KiB one kernel program copies")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.staged = _staged_configs(args.staged, args.engine, args.piece)
    args.protocol = args.protocol or ("nvlink" if args.device == "cuda" else "tcp")
    gp, gd = (int(x) for x in args.gpus.split(","))
    args.devices = (f"cuda:{gp}", f"cuda:{gd}") if args.device == "cuda" else ("cpu", "cpu")
    print(f"{LAYOUT} tp1 -> tp1, {args.engine} {args.protocol}, prefill {args.devices[0]} -> decode {args.devices[1]}, "
          f"median of {args.reps} (+1 warm-up)", flush=True)
    t_start = time.time()
    res = run(args)
    res.pop("_seq", None)
    ok = all(m.get("mismatched_bytes", 0) == 0 for s in res["sizes"] for m in s["modes"].values())
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report = {
        "benchmark": "gpu_transfer", "engine": args.engine, "protocol": args.protocol, "layout": LAYOUT,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": stamp, "seconds": time.time() - t_start, "byte_exact": ok,
        "machine": {"host": platform.node(), "gpu": res.get("device_name"), "devices": list(args.devices),
                    "python": platform.python_version()},
        "staging": args.staged, "reps": args.reps, "results": res,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-{args.engine}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1, default=_json_default))
    print(f"\nGB/s (decimal; request bytes / first send -> decode sees completion), transport {res.get('transport')}")
    modes = [m for m in _expand(args) if m != "kernels"]
    hdr = f"{'engine':9} {'tokens':>7} {'MiB':>6} {'blocks':>6} " + " ".join(f"{m.replace('staged-', 's'):>9}" for m in modes)
    print(hdr + "   4k latency (ms)")
    for s in res["sizes"]:
        row = " ".join(f"{s['modes'][m]['gbps']:>9.1f}" for m in modes)
        lat = " ".join(f"{m}={s['modes'][m]['median_s'] * 1e3:.2f}" for m in modes) if s["tokens"] <= 4096 else ""
        print(f"{args.engine:9} {s['tokens']:>7} {s['bytes'] / 2**20:>6.0f} {s['descriptors']:>6} {row}   {lat}")
    if any(c["prepared"] for c in args.staged):
        print("p configurations: plan built before the request starts; GB/s with its building time added:")
        for s in res["sizes"]:
            print(f"  {s['tokens']:>7} " + " ".join(f"{m}={v['gbps_with_prepare']:.1f}" for m, v in s["modes"].items()
                                                     if "gbps_with_prepare" in v))
    print(f"byte-exact after every mode: {ok}; wrote {path}")
    return 0 if ok else 1


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.integer | np.floating):
        return o.item()
    return str(o)


if __name__ == "__main__":
    raise SystemExit(main())
