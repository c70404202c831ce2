/* tests/vllm/shims/libcuda_stub.c plus the driver symbols Triton's own cuda_utils imports (vLLM's hybrid
 * model modules build Triton kernels' launchers at import). Every call still answers CUDA_ERROR_NO_DEVICE. */
#include "../vllm/shims/libcuda_stub.c"

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
