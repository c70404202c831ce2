#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian packages, a cached virtualenv with
# the pinned Python packages, and the control plane built from Go modules.
# Source it (`. scripts/setup.sh`) to get PDFLEET_VENV and PATH set.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfleet}
export PDFLEET_CACHE=$cache
mkdir -p "$cache"

say() { printf '[setup] %s\n' "$*" >&2; }

# 1. Debian packages (only what is missing; apt-get update once per machine).
need_apt=()
command -v go >/dev/null || need_apt+=(golang-go)
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
# The cluster's private network: ip (netns, veth, bridge), unshare/nsenter, and nft for kube-proxy.
command -v ip >/dev/null || need_apt+=(iproute2)
command -v nft >/dev/null || need_apt+=(nftables)
command -v curl >/dev/null || need_apt+=(curl)
# Mooncake's CPU wheel links libibverbs even when it only uses TCP.
ldconfig -p | grep -q 'libibverbs.so.1 ' || need_apt+=(libibverbs1)
if ((${#need_apt[@]})); then
  say "installing Debian packages: ${need_apt[*]}"
  if [ ! -f "$cache/.apt-updated" ]; then apt-get update -qq && touch "$cache/.apt-updated"; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
gov=$(go env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n1.26\n' "$gov" | sort -V | head -1)" != "1.26" ]; then
  echo "error: Go >= 1.26 is needed to build the control plane (found $gov)" >&2; exit 1
fi

# 2. A virtualenv keyed by the pinned dependencies, reused across clones.
key=$(python3 - "$repo/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = sorted(p["dependencies"]) + sorted(d for v in p["optional-dependencies"].values() for d in v)
print(hashlib.sha256("\n".join(deps).encode()).hexdigest()[:12])
PY
)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  say "creating $venv (torch is a large wheel: the first install takes minutes, pip's cache serves later ones)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --progress-bar off -e "$repo[dev,torch,engines,router,model]"
  touch "$venv/.complete"
fi
# The clone may have moved: re-point the editable install (seconds).
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" 2>/dev/null \
  || "$venv/bin/pip" install -q --no-deps -e "$repo"
export PDFLEET_VENV=$venv
export PATH="$venv/bin:$PATH"

# 3. The control plane, built from Go modules into the versioned cache.
"$venv/bin/pdfleet" dev build >/dev/null
say "ready: venv $venv, toolchain $("$venv/bin/python" -c 'from pdfleet_operator.devcluster.toolchain import toolchain_dir; print(toolchain_dir())')"
