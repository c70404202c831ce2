#!/usr/bin/env bash
# One device call per engine: checks, nvlink probe, GPU parity, then the transfer benchmark.
#   scripts/gpu/run.sh mooncake|nixl      (from the repo root; PYTHONPATH holds the wheels, runtime, operator)
# Writes everything under $OUT (default /tmp/pdfleet-gpu): run.log, probe.jsonl, parity.jsonl, gpu-<engine>-*.json.
set -uo pipefail
engine=${1:?usage: run.sh mooncake|nixl}
OUT=${OUT:-/tmp/pdfleet-gpu}
mkdir -p "$OUT"
# NVLink multicast stays off (KINDS.md): nothing here uses it, and a child must not turn it on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
quiet() { tee -a "$OUT/run.log" | grep -v '^[EWI][0-9]\{4\} \|^WARNING: Logging before'; }
{
  date -u; hostname
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print("p2p 0->1", torch.cuda.can_device_access_peer(0, 1))'
  nvidia-smi topo -m
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm --format=csv
  case $engine in
    mooncake) python3 -c 'import mooncake.engine, importlib.metadata as m; print("mooncake", m.version("mooncake-transfer-engine-cuda13"))' ;;
    nixl) python3 -c 'import nixl_cu13._api, importlib.metadata as m; print("nixl", m.version("nixl-cu13"))' ;;
  esac
  python3 -c 'import pydantic; print("pydantic", pydantic.VERSION)'
} 2>&1 | quiet

tls=table
if [ "$engine" = nixl ]; then
  python3 scripts/gpu/probe.py --engine nixl --ucx-tls table all 2>&1 | quiet | tee "$OUT/probe.jsonl"
else
  python3 scripts/gpu/probe.py --engine mooncake 2>&1 | quiet | tee "$OUT/probe.jsonl"
fi
chosen=$(grep '^CHOSEN ' "$OUT/probe.jsonl" | tail -1 | cut -d' ' -f2)
[ -n "$chosen" ] && [ "$chosen" != none ] && tls=$chosen
echo "UCX_TLS for the runs: $tls" | quiet

python3 scripts/gpu/parity.py --backend "$engine" --ucx-tls "$tls" 2>&1 | quiet | tee "$OUT/parity.jsonl"
parity_rc=${PIPESTATUS[0]}

extra=()
[ "$engine" = nixl ] && [ "$tls" != table ] && extra=(--ucx-tls "$tls")
python3 bench/gpu_transfer.py --engine "$engine" --out "$OUT" "${extra[@]}" "${@:2}" 2>&1 | quiet
bench_rc=${PIPESTATUS[0]}
echo "parity rc=$parity_rc bench rc=$bench_rc"
exit $(( parity_rc || bench_rc ))
