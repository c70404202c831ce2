"""The staging fast path's plan and kernels on host tensors (the GPU run is tests/gpu and bench/gpu_transfer.py)."""

from __future__ import annotations

import threading

import numpy as np
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


def test_plan_rows_chunks_and_bytes() -> None:
    src, dst, length = _blocks(np.random.default_rng(1))
    plan = staging.StagePlan.build(src, dst, length, 64 << 10)
    assert [g.row for g in plan.groups] == [256, 32, 16]
    assert plan.bytes == int(length.sum())
    assert sum(s.r1 - s.r0 for c in plan.chunks for s in c.segments) == sum(g.rows for g in plan.groups)
    assert all(c.nbytes <= 64 << 10 for c in plan.chunks)
    # the receiver's plan (offsets swapped) cuts rows identically
    other = staging.StagePlan.build(dst, src, length, 64 << 10)
    assert [c.segments for c in other.chunks] == [c.segments for c in plan.chunks]


def test_gather_then_scatter_moves_every_block_and_nothing_else() -> None:
    rng = np.random.default_rng(2)
    src, dst, length = _blocks(rng)
    a = rng.integers(0, 255, 6 << 20, dtype=np.uint8)
    b = rng.integers(0, 255, 6 << 20, dtype=np.uint8)
    want = _expected(src, dst, length, a, b)
    ta, tb = torch.from_numpy(a.copy()), torch.from_numpy(b.copy())
    send = staging.StagePlan.build(src, dst, length, 96 << 10).materialize("cpu")
    recv = staging.StagePlan.build(dst, src, length, 96 << 10).materialize("cpu")
    slot = torch.empty(96 << 10, dtype=torch.uint8)
    for k in range(len(send.chunks)):
        staging.gather_chunk(send, k, ta, slot)
        staging.scatter_chunk(recv, k, slot, tb)
    assert np.array_equal(tb.numpy(), want)


def test_send_and_receive_pipeline_through_a_small_ring() -> None:
    """Two threads, a ring of 2 slots smaller than the request: credits must gate slot reuse."""
    rng = np.random.default_rng(3)
    src, dst, length = _blocks(rng)
    a = torch.from_numpy(rng.integers(0, 255, 6 << 20, dtype=np.uint8))
    b = torch.from_numpy(rng.integers(0, 255, 6 << 20, dtype=np.uint8))
    want = _expected(src, dst, length, a.numpy(), b.numpy())
    chunk = 32 << 10
    ring_a, ring_b = staging.StagingRing(2, chunk, "cpu"), staging.StagingRing(2, chunk, "cpu")
    send = staging.StagePlan.build(src, dst, length, chunk).materialize("cpu")
    recv = staging.StagePlan.build(dst, src, length, chunk).materialize("cpu")
    sig = _Counters()

    def post(k: int, address: int, nbytes: int):  # the "engine": copy into the peer's slot k
        assert address == ring_a.address(k)
        ring_b.slot(k)[:nbytes].copy_(ring_a.slot(k)[:nbytes])
        return lambda: True

    t = threading.Thread(target=staging.receive, args=(recv, b, ring_b, sig), kwargs={"timeout_s": 60})
    t.start()
    n = staging.send(send, a, ring_a, post, sig, timeout_s=60)
    t.join(60)
    assert n == len(send.chunks) > 2 and sig.freed() == n
    assert np.array_equal(b.numpy(), want)
