#!/usr/bin/env bash
# One device call per engine, through `pdfleet-runtime serve`: parity (every byte checked; PARITY=0 skips
# it, ~60-230 s), then bench/gpu_serve.py (staged vs direct vs the peer copy, the staged timeline; ~350-410 s
# for 4k/32k/128k at 5 reps). From the repo root, with the engine's wheels and the serve dependencies in
# .whl-<engine>/ (WHL=dir to name another; see docs/gpu.md). Output under $OUT.
#   OUT=$OUT bash scripts/gpu/serve.sh mooncake|nixl [bench args: --prefill-gpu 0 --decode-gpu 1, --hetero ...]
set -uo pipefail
engine=${1:?usage: serve.sh mooncake|nixl [bench args]}
OUT=${OUT:-/tmp/pdfleet-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHL:-.whl-$engine}"/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD/operator:$PWD
quiet() { tee -a "$OUT/serve.log" | grep -v '^[EWI][0-9]\{4\} \|^WARNING: Logging before'; }
{
  date -u
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'
  python3 -c 'import aiohttp, prometheus_client, pydantic, yaml; print("serve deps ok")'
} 2>&1 | quiet
parity_rc=0
if [ "${PARITY:-1}" != 0 ]; then
  timeout 230 python3 scripts/gpu/serve_parity.py --engine "$engine" --out "$OUT" 2>&1 | quiet
  parity_rc=${PIPESTATUS[0]}
fi
timeout "${BENCH_TIMEOUT:-540}" python3 bench/gpu_serve.py --engine "$engine" --out "$OUT" "${@:2}" 2>&1 | quiet
bench_rc=${PIPESTATUS[0]}
echo "serve parity rc=$parity_rc bench rc=$bench_rc" | quiet
