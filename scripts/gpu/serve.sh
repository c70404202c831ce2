#!/usr/bin/env bash
# One device call per engine, through `pdfleet-runtime serve` on one GPU: parity (every byte checked),
# then bench/gpu_serve.py (staged vs direct vs a same-device copy). From the repo root, with the
# engine's wheels and the serve dependencies in .whl-<engine>/ (see docs/gpu.md). Output under $OUT.
#   OUT=$OUT bash scripts/gpu/serve.sh mooncake|nixl [bench args]
set -uo pipefail
engine=${1:?usage: serve.sh mooncake|nixl [bench args]}
OUT=${OUT:-/tmp/pdfleet-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    ".whl-$engine"/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD/operator:$PWD
quiet() { tee -a "$OUT/serve.log" | grep -v '^[EWI][0-9]\{4\} \|^WARNING: Logging before'; }
{
  date -u
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'
  python3 -c 'import aiohttp, prometheus_client, pydantic, yaml; print("serve deps ok")'
} 2>&1 | quiet
timeout 230 python3 scripts/gpu/serve_parity.py --engine "$engine" --out "$OUT" 2>&1 | quiet
parity_rc=${PIPESTATUS[0]}
timeout 330 python3 bench/gpu_serve.py --engine "$engine" --out "$OUT" "${@:2}" 2>&1 | quiet
bench_rc=${PIPESTATUS[0]}
echo "serve parity rc=$parity_rc bench rc=$bench_rc" | quiet
