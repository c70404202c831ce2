"""The staging fast path's plan and kernels on host tensors (the GPU run is tests/gpu and bench/gpu_transfer.py).

The Triton kernel itself runs here under Triton's interpreter (``TRITON_INTERPRET=1``, in a child
process: the switch is read when the kernel is defined), on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pdfleet_runtime import staging


class _Counters:
    def __init__(self) -> None:
        self.values = [0, 0]

    def landed(self) -> int:
        return self.values[0]

    def set_landed(self, n: int) -> None:
        self.values[0] = n

    def freed(self) -> int:
        return self.values[1]

    def set_freed(self, n: int) -> None:
        self.values[1] = n


def _blocks(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pages of 4 KiB at 256-aligned bases, a 2 MiB block and two tiny odd-sized entries (16 and 32 bytes)."""
    pages = 200
    src = np.concatenate([rng.permutation(400)[:pages] * 4096 + 256, [3 << 20], [5 << 20], [(5 << 20) + 64]])
    dst = np.concatenate([rng.permutation(300)[:pages] * 4096, [2 << 20], [(4 << 20) + 16], [(4 << 20) + 96]])
    length = np.concatenate([np.full(pages, 4096), [2 << 20], [16], [32]])
    return src.astype(np.int64), dst.astype(np.int64), length.astype(np.int64)


def _expected(src: np.ndarray, dst: np.ndarray, length: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    want = b.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        want[d : d + n] = a[s : s + n]
    return want


def _bytes(plan: staging.StagePlan) -> np.ndarray:
    return plan.table.numpy() * plan.elem


@pytest.mark.parametrize("chunk,piece", [(64 << 10, 64 << 10), (96 << 10, 16 << 10), (300 * 256, 8 << 10),
                                         (8 << 20, 256 << 10)])
def test_pieces_cover_every_byte_once_within_chunks_and_pieces(chunk: int, piece: int) -> None:
    src, dst, length = _blocks(np.random.default_rng(1))
    plan = staging.StagePlan.build(src, length, chunk, piece)
    t = _bytes(plan)
    assert plan.unit == 16 and plan.bytes == int(length.sum())
    assert len(plan.chunks) == -(-plan.bytes // chunk)
    assert all(c.nbytes == min(chunk, plan.bytes - k * chunk) for k, c in enumerate(plan.chunks))
    assert (t[:, 2] > 0).all() and (t[:, 2] <= piece).all()
    for c in plan.chunks:  # pieces of a chunk tile its slot bytes [0, nbytes) in order, without gaps
        rows = t[c.p0 : c.p1]
        assert rows[0, 1] == 0 and (rows[1:, 1] == rows[:-1, 1] + rows[:-1, 2]).all()
        assert rows[-1, 1] + rows[-1, 2] == c.nbytes
    # every source byte once: the pieces, mapped back, are exactly the blocks
    pos = np.cumsum(length) - length
    starts = np.repeat([k * chunk for k in range(len(plan.chunks))], [c.p1 - c.p0 for c in plan.chunks]) + t[:, 1]
    blk = np.searchsorted(pos, starts, side="right") - 1
    assert (t[:, 0] == src[blk] + starts - pos[blk]).all()
    # the receiver cuts the same stream identically (slot offsets and lengths), with its own offsets
    other = staging.StagePlan.build(dst, length, chunk, piece)
    assert np.array_equal(_bytes(other)[:, 1:], t[:, 1:]) and other.chunks == plan.chunks
    # no needless cut: a block yields one piece per chunk it touches, split only past ``piece`` bytes
    want, at = 0, 0
    for n in length.tolist():
        while n:
            seg = min(n, chunk - at % chunk)
            want, at, n = want + -(-seg // piece), at + seg, n - seg
    assert len(t) == want


def test_unit_follows_the_coarsest_alignment_and_empty_blocks_drop() -> None:
    plan = staging.StagePlan.build(np.array([8, 64, 99]), np.array([8, 16, 0]), 256)
    assert plan.unit == 8 and plan.elem == 8 and len(plan.table) == 2
    plan = staging.StagePlan.build(np.array([3, 64]), np.array([5, 16]), 256)
    assert plan.unit == 1 and plan.elem == 1
    assert staging.StagePlan.build(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 256).chunks == []
    with pytest.raises(ValueError):
        staging.StagePlan.build(np.array([0]), np.array([16]), 100)


def test_chunk_size_splits_small_requests_and_caps_at_the_slot() -> None:
    assert staging.chunk_size(200 << 20, 128 << 20, 4) == 50 << 20
    assert staging.chunk_size(2 << 30, 128 << 20, 4) == 128 << 20
    assert staging.chunk_size(4 << 20, 128 << 20, 4) == 8 << 20  # the floor
    assert staging.chunk_size(1000, 128 << 20, 4, floor=0) % 256 == 0


@pytest.mark.parametrize("chunk,piece", [(96 << 10, 64 << 10), (300 * 256, 8 << 10)])
def test_gather_then_scatter_moves_every_block_and_nothing_else(chunk: int, piece: int) -> None:
    rng = np.random.default_rng(2)
    src, dst, length = _blocks(rng)
    a = rng.integers(0, 255, 6 << 20, dtype=np.uint8)
    b = rng.integers(0, 255, 6 << 20, dtype=np.uint8)
    want = _expected(src, dst, length, a, b)
    ta, tb = torch.from_numpy(a.copy()), torch.from_numpy(b.copy())
    send = staging.StagePlan.build(src, length, chunk, piece)
    recv = staging.StagePlan.build(dst, length, chunk, piece)
    slot = torch.empty(chunk, dtype=torch.uint8)
    for k in range(len(send.chunks)):
        staging.gather_chunk(send, k, ta, slot)
        staging.scatter_chunk(recv, k, slot, tb)
    assert np.array_equal(tb.numpy(), want)


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_send_and_receive_pipeline_through_a_small_ring(lookahead: int) -> None:
    """Two threads, a ring of 2 slots smaller than the request: credits must gate slot reuse."""
    rng = np.random.default_rng(3)
    src, dst, length = _blocks(rng)
    a = torch.from_numpy(rng.integers(0, 255, 6 << 20, dtype=np.uint8))
    b = torch.from_numpy(rng.integers(0, 255, 6 << 20, dtype=np.uint8))
    want = _expected(src, dst, length, a.numpy(), b.numpy())
    chunk = 32 << 10
    ring_a, ring_b = staging.StagingRing(2, chunk, "cpu"), staging.StagingRing(2, chunk, "cpu")
    send = staging.StagePlan.build(src, length, chunk)
    recv = staging.StagePlan.build(dst, length, chunk)
    sig = _Counters()

    def post(k: int, address: int, nbytes: int):  # the "engine": copy into the peer's slot k
        assert address == ring_a.address(k)
        ring_b.slot(k)[:nbytes].copy_(ring_a.slot(k)[:nbytes])
        return lambda: True

    t = threading.Thread(target=staging.receive, args=(recv, b, ring_b, sig), kwargs={"timeout_s": 60})
    t.start()
    n = staging.send(send, a, ring_a, post, sig, timeout_s=60, lookahead=lookahead)
    t.join(60)
    assert n == len(send.chunks) > 2 and sig.freed() == n
    assert np.array_equal(b.numpy(), want)


_INTERPRETED = textwrap.dedent("""
    import numpy as np, torch
    from pdfleet_runtime import staging
    rng = np.random.default_rng(4)
    pages = 40
    src = np.concatenate([rng.permutation(80)[:pages] * 65536 + 256, [7 << 20], [9 << 20], [(9 << 20) + 64]])
    dst = np.concatenate([rng.permutation(60)[:pages] * 65536, [6 << 20], [(8 << 20) + 16], [(8 << 20) + 96]])
    length = np.concatenate([rng.choice([16384, 65536, 1536], pages), [2 << 20], [16], [32]])
    cases = [(src, dst, length, 1 << 20, 64 << 10), (src, dst, length, 300 * 256, 16 << 10),
             (src + 8, dst, length, 4 << 20, 8 << 10), (src + 3, dst + 5, length, 1 << 20, 64 << 10)]
    for s, d, n, chunk, piece in cases:
        a = rng.integers(0, 255, 10 << 20, dtype=np.uint8)
        b = rng.integers(0, 255, 10 << 20, dtype=np.uint8)
        want = b.copy()
        for x, y, m in zip(s.tolist(), d.tolist(), n.tolist()):
            want[y : y + m] = a[x : x + m]
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        sp, rp = staging.StagePlan.build(s, n, chunk, piece), staging.StagePlan.build(d, n, chunk, piece)
        slot = torch.full((chunk,), 7, dtype=torch.uint8)
        for k in range(len(sp.chunks)):
            staging.gather_chunk(sp, k, ta, slot, kernel="triton")
            staging.scatter_chunk(rp, k, slot, tb, kernel="triton")
        assert np.array_equal(tb.numpy(), want), (chunk, piece, sp.unit)
        print("ok", sp.unit, rp.unit, len(sp.chunks), len(sp.table))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_the_interpreter_is_byte_exact() -> None:
    """The kernel the GPU runs (16-, 8- and 1-byte units; pieces cut at chunk ends and at piece_bytes)."""
    runtime = Path(staging.__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(runtime), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    units = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok")]
    assert units == ["16", "16", "8", "1"]
