#!/usr/bin/env bash
# The staged fast path (issue 15) in one device call per engine: facts, the staging GPU tests (Triton
# kernel, one GPU), then bench/gpu_transfer.py with peer, kernels and staged modes (no raw/adapter:
# their baselines are in the issue 14 runs). Extra args go to the benchmark.
#   scripts/gpu/staged.sh mooncake|nixl [--staged 128x3oa4 ...] [--reps N]
# (from the repo root; PYTHONPATH holds the wheels, runtime, operator). Output under $OUT: run.log, gpu-<engine>-*.json.
set -uo pipefail
engine=${1:?usage: staged.sh mooncake|nixl [bench args]}
OUT=${OUT:-/tmp/pdfleet-gpu}
mkdir -p "$OUT"
# NVLink multicast stays off (KINDS.md): nothing here uses it, and a child must not turn it on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
quiet() { tee -a "$OUT/run.log" | grep -v '^[EWI][0-9]\{4\} \|^WARNING: Logging before'; }
{
  date -u
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv,noheader
  python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu -k staging 2>&1 | tail -3
} 2>&1 | quiet
tests_rc=${PIPESTATUS[0]}
python3 bench/gpu_transfer.py --engine "$engine" --out "$OUT" --modes kernels peer staged "${@:2}" 2>&1 | quiet
bench_rc=${PIPESTATUS[0]}
echo "bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
