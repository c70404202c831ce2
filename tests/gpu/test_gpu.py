"""GPU tests: CUDA pools through the real engines over nvlink, and the staging kernels on a GPU.

They need a CUDA GPU (two for the cross-GPU cases) and the CUDA builds of the engines, so they run
on the device machine (``scripts/gpu/run.sh`` runs the same flows with their output kept); anywhere
else every test here is skipped with that reason and never counts as passing.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

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


def test_staging_round_trip_is_byte_exact_on_one_gpu() -> None:
    from pdfleet_runtime import staging

    dev = torch.device("cuda:0")
    rng = np.random.default_rng(3)
    pages = rng.choice(4096, size=1024, replace=False)
    src = (pages * 65536 + 512).astype(np.int64)
    dst = (rng.permutation(4096)[:1024] * 65536).astype(np.int64)
    length = np.full(1024, 65536, dtype=np.int64)
    a = torch.randint(0, 255, (4096 * 65536 + 1024,), dtype=torch.uint8, device=dev)
    b = torch.zeros(4096 * 65536, dtype=torch.uint8, device=dev)
    send = staging.StagePlan.build(src, dst, length, 8 << 20).materialize(dev)
    recv = staging.StagePlan.build(dst, src, length, 8 << 20).materialize(dev)
    slot = torch.empty(8 << 20, dtype=torch.uint8, device=dev)
    for k in range(len(send.chunks)):
        staging.gather_chunk(send, k, a, slot)
        staging.scatter_chunk(recv, k, slot, b)
    got, want = b.cpu().numpy(), np.zeros(b.numel(), dtype=np.uint8)
    host = a.cpu().numpy()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        want[d : d + 65536] = host[s : s + 65536]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("backend,module", [("mooncake", "mooncake.engine"), ("nixl", "nixl_cu13._api")])
@pytest.mark.parametrize("prefill,decode", [("tp=1", "tp=1"), ("tp=2", "tp=1")])
def test_parity_over_nvlink_across_gpus(backend: str, module: str, prefill: str, decode: str) -> None:
    _two_gpus()
    _engine(module)
    from pdfleet_runtime.multiproc import CaseSpec, GroupSpec, run_group
    from pdfleet_runtime.records import ParallelShape
    from pdfleet_runtime.transfer import Protocol

    # NIXL's matrix column rejects replicated PLE state across TP 2 -> 1: that shape runs without PLE.
    layout = "qwen3-next-hybrid" if backend == "nixl" and prefill != decode else "qwen3.8-flash-next"
    spec = GroupSpec(backend, ParallelShape.parse(prefill), ParallelShape.parse(decode),
                     (CaseSpec(layout, 2, 1024, 7),), device="cuda", protocol=Protocol.NVLINK)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_group(spec, Path(tmp))[0]
    assert result.ok, (result.first_mismatch, result.mismatched_bytes, result.rejection)
    assert set(result.details["devices"].values()) == {"cuda:0", "cuda:1"}
