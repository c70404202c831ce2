"""Three shims that let vLLM 0.33.0's own code run on a CPU machine as it runs on an H200 pod, up to the GPU.

Runs in the vLLM venv (scripts/vllm-venv.sh), imported by tests/vllm/check_vllm.py before ``vllm``:

1. ``load_libcuda(path)``: a stand-in ``libcuda.so.1`` (``libcuda_stub.c``, built with the machine's gcc at
   test time) loaded ``RTLD_GLOBAL``, so vLLM's compiled extensions resolve the driver symbols they import;
   every call answers CUDA_ERROR_NO_DEVICE.
2. ``triton_driver_active()``: Triton's NVIDIA driver reported active. Otherwise
   ``vllm/triton_utils/importing.py`` swaps in a placeholder Triton that breaks
   ``model_executor/layers/mamba/ops/ssd_chunk_scan.py`` at import (reached whenever NIXL is named).
3. ``install_platform()``: ``vllm.platforms._current_platform`` set to ``FakeH200``, a ``CudaPlatformBase``
   subclass with fixed facts of an H200 node (capability 9.0, 141 GiB, 8 devices, NVLink). vLLM's own CPU
   platform validates differently (no world-size check, other attention backends): the wrong reference.

And one speed-up, ``inspect_models_ahead``: vLLM's registry inspects each model class in the checker's own
process, before its children fork, instead of in a fresh interpreter per class and child.

Nothing else of vLLM is replaced: its parser, ``vllm serve``'s checks, ``create_engine_config`` and the
scheduler-side KV connectors are its own.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

DEVICES = 8
MEMORY_BYTES = 141 * (1 << 30)
STUB_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libcuda_stub.c")


def build_libcuda(directory: str) -> str:
    """Compile the stand-in driver with the machine's gcc; its soname is libcuda.so.1, so the dynamic
    linker takes it for the extensions' DT_NEEDED once it is loaded."""
    out = os.path.join(directory, "libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", out, STUB_SOURCE],
                   check=True, capture_output=True, timeout=120)
    return out


def activate(libcuda: str) -> None:
    """All three shims, in the order vLLM needs them (the platform after ``import vllm``)."""
    load_libcuda(libcuda)
    triton_driver_active()
    import vllm  # noqa: F401

    install_platform()


def load_libcuda(path: str) -> None:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def triton_driver_active() -> None:
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)


def install_platform() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class FakeH200(CudaPlatformBase):
        """An 8 x H200 node, as NVML would describe it."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return f"GPU-00000000-0000-0000-0000-00000000000{device_id}"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return MEMORY_BYTES

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return DEVICES

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0) -> int | None:
            return None

        @classmethod
        def get_all_device_numa_nodes(cls) -> list[int] | None:
            return None

    platforms._current_platform = FakeH200()


def inspect_models_ahead(archs: set[str], libcuda: str, cache_root: str) -> None:
    """Each model class of ``archs``, inspected once in this process, so forked children find it inspected.

    vLLM inspects a model class (``_ModelInfo``: hybrid, MLA, pipeline support...) in a fresh interpreter, so
    that loading it cannot initialize CUDA in the caller: 10-15 s an architecture, paid by the first child of
    each. With the stand-in driver there is no CUDA to keep out, so vLLM's own ``inspect_model_cls`` runs here
    with its subprocess call made in-process (Triton finds the stand-in by ``TRITON_LIBCUDA_PATH``: hybrid
    model modules build kernel launchers at import); the children find the answer in the registry's cache,
    as a second lookup in one vLLM process does, and the class already imported. A class that fails here
    is left to the children, as before. vLLM's file cache of inspections goes to ``cache_root``."""
    import sys

    from vllm.model_executor.models import registry

    saved = {k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "TRITON_LIBCUDA_PATH")}
    os.environ.update(VLLM_CACHE_ROOT=cache_root, TRITON_LIBCUDA_PATH=os.path.dirname(os.path.abspath(libcuda)))
    in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        for arch in sorted(archs):
            model = registry.ModelRegistry.models.get(arch)
            if model is None:
                continue
            try:
                model.inspect_model_cls()  # raises where the registry's cached lookup would log and keep None
            except Exception as exc:
                print(f"h200: {arch} not inspected ahead ({type(exc).__name__}: {exc}); its first case will",
                      file=sys.stderr)
                continue
            registry._try_inspect_model_cls(arch, model)  # from the file cache just written, into the registry's
    finally:
        registry._run_in_subprocess = in_subprocess
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
