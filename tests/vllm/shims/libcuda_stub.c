/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, for the vLLM checks only
 * (tests/vllm/shims/h200.py loads it RTLD_GLOBAL before vLLM). vLLM's compiled extensions import the first
 * 17 driver symbols (`nm -D --undefined-only` over vllm/*.so, vLLM 0.33.0); with them defined the real
 * extensions load. The last 10 are what Triton's own cuda_utils imports (found by TRITON_LIBCUDA_PATH):
 * vLLM's hybrid model modules build Triton kernels' launchers at import. Every call answers
 * CUDA_ERROR_NO_DEVICE (100): nothing here pretends a GPU works. */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100
#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuTensorMapEncodeTiled)

NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxGetLimit)
NO_DEVICE(cuCtxSetLimit)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuFuncGetAttribute)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuFuncSetCacheConfig)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleUnload)

int cuGetErrorString(int error, const char **text) {
    if (text != NULL) *text = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device (pdfleet's stand-in libcuda)" : "unknown";
    return 0;
}
