"""GPU tests: CUDA pools through the real engines over nvlink, and the staging kernels on a GPU.

They need a CUDA GPU (two for the cross-GPU cases) and the CUDA builds of the engines, so they run
on the device machine (``scripts/gpu/run.sh`` runs the same flows with their output kept); anywhere
else every test here is skipped with that reason and never counts as passing.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SKIP_REASON = "needs a CUDA GPU (runs on the device machine: scripts/gpu/run.sh)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=SKIP_REASON)]


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (runs on the device machine: scripts/gpu/run.sh)")


def _engine(module: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is not installed (the device scripts install it from carried wheels)")


def _staging_round_trip(dev: str, shift: int, kernel: str | None = None) -> None:
    from pdfleet_runtime import staging

    rng = np.random.default_rng(3 + shift)
    pages, big = 1024, 4
    length = rng.choice([65536, 16384, 1536], size=pages, p=[0.6, 0.3, 0.1]).astype(np.int64)
    src = rng.choice(4096, size=pages, replace=False) * 65536 + 512 + shift
    dst = rng.permutation(4096)[:pages] * 65536
    base = 4096 * 65536  # 2 MiB blocks after the pages
    src = np.concatenate([src, base + np.arange(big) * (2 << 20) + 1024 + shift]).astype(np.int64)
    dst = np.concatenate([dst, base + rng.permutation(8)[:big] * (2 << 20)]).astype(np.int64)
    length = np.concatenate([np.minimum(length, 65536 - 512 - shift), np.full(big, (2 << 20) - 1024 - shift)])
    size = base + (16 << 20)
    a = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    b = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    host_a, want = a.cpu().numpy(), b.cpu().numpy().copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        want[d : d + n] = host_a[s : s + n]
    send = staging.StagePlan.build(src, length, 8 << 20, device=dev)
    recv = staging.StagePlan.build(dst, length, 8 << 20, device=dev)
    assert send.unit == (16 if shift == 0 else shift) and len(send.chunks) > 4
    slot = torch.empty(8 << 20, dtype=torch.uint8, device=dev)
    for k in range(len(send.chunks)):
        staging.gather_chunk(send, k, a, slot, kernel)
        staging.scatter_chunk(recv, k, slot, b, kernel)
    assert np.array_equal(b.cpu().numpy(), want)


@pytest.mark.parametrize("shift,side", [(0, False), (8, False), (1, False), (0, True)])
def test_staging_round_trip_is_byte_exact_on_one_gpu(shift: int, side: bool) -> None:
    """The Triton kernel on 16-, 8- and 1-byte units, pieces cut at chunk ends (8 MiB) and at 64 KiB
    (2 MiB blocks), the table cut on the GPU (once on a side stream); the whole arena is checked
    against a per-block host copy."""
    if side:
        stream = torch.cuda.Stream("cuda:0")
        with torch.cuda.stream(stream):
            _staging_round_trip("cuda:0", shift)
        stream.synchronize()
        return
    _staging_round_trip("cuda:0", shift)


@pytest.mark.parametrize("backend,module", [("mooncake", "mooncake.engine"), ("nixl", "nixl_cu13._api")])
@pytest.mark.parametrize("prefill,decode", [("tp=1", "tp=1"), ("tp=2", "tp=1")])
def test_parity_over_nvlink_across_gpus(backend: str, module: str, prefill: str, decode: str) -> None:
    _two_gpus()
    _engine(module)
    from pdfleet_runtime.links import LinkProtocol
    from pdfleet_runtime.records import ParallelShape
    from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
    from pdfleet_runtime.verify.group import run_group

    # NIXL's matrix column rejects replicated PLE state across TP 2 -> 1: that shape runs without PLE.
    layout = "qwen3-next-hybrid" if backend == "nixl" and prefill != decode else "qwen3.8-flash-next"
    spec = GroupSpec(backend, ParallelShape.parse(prefill), ParallelShape.parse(decode),
                     (CaseSpec(layout, 2, 1024, 7),), device="cuda", protocol=LinkProtocol.NVLINK)
    result = run_group(spec)[0]
    assert result.ok, (result.first_mismatch, result.mismatched_bytes, result.rejection)
    assert result.details is not None and set(result.details.devices.values()) == {"cuda:0", "cuda:1"}
