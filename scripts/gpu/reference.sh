#!/usr/bin/env bash
# Token parity of the reference engine on one GPU (issue 42's device acceptance): a qwen3_next model with the
# real hidden size and head counts, 4 layers, random weights (seed), bf16; prefill and decode rank processes
# on the GPU through the staged path of the engine; PD's tokens against transformers' greedy generate.
#   scripts/gpu/reference.sh mooncake|nixl [--layers N] [--prompt-tokens N] [--small]
# (from the repo root; PYTHONPATH holds the engine's wheels and transformers 5.23.0's, runtime, operator).
# Output under $OUT (default /tmp/pdfleet-gpu): run.log and reference-<engine>-<pair>.json per pairing.
set -uo pipefail
engine=${1:?usage: reference.sh mooncake|nixl [--layers N] [--prompt-tokens N] [--small]}
shift
layers=4 tokens=4096 small=()
while [ $# -gt 0 ]; do
  case $1 in
    --layers) layers=$2; shift 2 ;;
    --prompt-tokens) tokens=$2; shift 2 ;;
    --small) small=(--small); shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/pdfleet-gpu}
mkdir -p "$OUT"
# NVLink multicast stays off (KINDS.md): nothing here uses it, and a child must not turn it on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
quiet() { tee -a "$OUT/run.log" | grep -v '^[EWI][0-9]\{4\} \|^WARNING: Logging before\|falling back'; }
device=cuda; [ ${#small[@]} -gt 0 ] && device=cpu
{
  date -u
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | quiet
model=$(python3 scripts/gpu/reference_model.py "$OUT/qwen3-next-real-dims" --layers "$layers" "${small[@]}")
rc=0
# TP 1 -> 1, and the largest pairing one H200 host holds with every rank computing the full model (~2 GB of
# weights each, one CPU thread each: 16 rank processes for 8 -> 8 on the host's 16 cores): 8 -> 8 (GDN 16 key
# heads; 2 KV heads, so TP 8 replicates each on four ranks), and 8 -> 2 across TP sizes. PAIRS overrides.
default="tp=1,tp=1 tp=8,tp=8 tp=8,tp=2"; [ ${#small[@]} -gt 0 ] && default="tp=1,tp=1 tp=4,tp=2"
pairs=${PAIRS:-$default}
for pair in $pairs; do
  pair=${pair/,/ }
  set -- $pair
  name="reference-$engine-${1#tp=}-${2#tp=}"
  python3 -m pdfleet_runtime parity --model "$model" --prefill "$1" --decode "$2" --backend "$engine" \
      --device "$device" --requests 2 --tokens "$tokens" --max-new-tokens 16 --init-seed 1 --json \
      > "$OUT/$name.json" 2> >(quiet >&2)
  r=$?
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], "ok" if d["ok"] else "MISMATCH", d["prefill"], "->", d["decode"], "max |logit diff|", d["max_logit_diff"], [c["tokens"] for c in d["cases"]], d["failures"], d["seconds"])' "$OUT/$name.json" "$name" 2>&1 | quiet
  [ $r -ne 0 ] && rc=$r
done
echo "reference rc=$rc" | quiet
exit $rc
