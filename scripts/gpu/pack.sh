#!/usr/bin/env bash
# The packages a device call needs, for the device's Python 3.12, as one xz archive under 64 MiB:
#   bash scripts/gpu/pack.sh mooncake|nixl      -> .whl-gpu/site-<engine>.tar.xz (git-ignored)
# The engine wheels alone are 50 MB (Mooncake) and 59 MB (NIXL), so wheels as such do not fit beside the tree;
# the parts a transfer engine never loads (Mooncake's store, EP and collective libraries and its binaries; NIXL's
# EP extension built for three torch versions and UCX's perftest) are left out. On the device:
#   mkdir -p /tmp/site && tar -xJf .whl-gpu/site-<engine>.tar.xz -C /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD/operator
set -euo pipefail
engine=${1:?usage: pack.sh mooncake|nixl}
cd "$(dirname "$0")/../.."
case $engine in
  mooncake) engine_wheels=(mooncake-transfer-engine-cuda13==0.3.14) ;;
  nixl) engine_wheels=(nixl-cu13==1.5.1 nixl==1.5.1) ;;
  *) echo "unknown engine $engine" >&2; exit 2 ;;
esac
# transformers as the runtime pins it, its hub client (which wants newer typing_extensions, click, anyio, idna
# and h11 than the device has), pydantic and pyyaml (absent there), aiohttp for serve.
model=(transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 httpx2==2.17.0
       httpcore2==2.17.0 truststore==0.10.5 typing_extensions==4.16.0 click==8.5.1 anyio==4.16.0 idna==3.21
       h11==0.16.0 typer==0.29.2 shellingham==1.5.4 sniffio==1.3.1 pydantic==2.14.4 pydantic_core==2.50.5
       annotated_types==0.7.0 typing_inspection==0.4.5 pyyaml==6.0.4 regex==2026.12.2 tqdm==4.70.1
       filelock==4.3.2 fsspec==2026.9.0 packaging==26.4 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1
       frozenlist==1.8.0 aiosignal==1.4.0 attrs==26.1.0 propcache==0.5.4 aiohappyeyeballs==2.7.1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for n in 28 27 17 34 35 31 24; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$work/wheels" "${engine_wheels[@]}" "${model[@]}"
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
cd "$work/site"
rm -rf mooncake/_store.*.so mooncake/_ep.*.so mooncake/libmooncake_pg*.so mooncake/libmooncake_ep_device.so \
    mooncake/mooncake_client mooncake/mooncake_master mooncake/transfer_engine_bench \
    mooncake_transfer_engine_cuda13.libs/lib{crypto,etcd_wrapper,pgm,sodium,unwind,uring,xxhash,zmq,zstd,asio}-*.so* \
    nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest*
find . -name '__pycache__' -prune -exec rm -rf {} +
chmod -R u+rwX,go+rX .
out=$OLDPWD/.whl-gpu
mkdir -p "$out"
tar -cf - . | xz -T2 -6 > "$out/site-$engine.tar.xz.tmp"
mv "$out/site-$engine.tar.xz.tmp" "$out/site-$engine.tar.xz"
ls -l "$out/site-$engine.tar.xz"
