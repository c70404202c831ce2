#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian packages, a cached virtualenv with
# the pinned Python packages, and the control plane built from Go modules.
# Source it (`. scripts/setup.sh`) to get PDFLEET_VENV (this checkout's layer) and PATH set.
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
# Prometheus 2.42 and promtool (docs/monitoring.md: the rules' promtool tests, the e2e's own prometheus process).
# The packaged service is never started: policy-rc.d denies it during the install (one is written only if none is).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  say "installing Debian package: prometheus (its service is not started)"
  if [ ! -f "$cache/.apt-updated" ]; then apt-get update -qq && touch "$cache/.apt-updated"; fi
  policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d; printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"
  fi
  rc=0; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null || rc=$?
  if [ -n "$policy" ]; then rm -f "$policy"; fi
  if [ "$rc" != 0 ]; then echo "error: apt-get install prometheus failed ($rc)" >&2; exit 1; fi
fi
gov=$(go env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n1.26\n' "$gov" | sort -V | head -1)" != "1.26" ]; then
  echo "error: Go >= 1.26 is needed to build the control plane (found $gov)" >&2; exit 1
fi

# 3 begins beside 2: the toolchain's Go builds (standard-library Python only) overlap pip's downloads on a
# cold machine; on a warm one it finds the cache and ends at once. Whatever it left undone (it failed, or the
# machine has no python3 that runs it), `pdfleet dev build` below does, under the same lock.
toolchain_pid=
python3 "$repo/scripts/toolchain.py" >/dev/null & toolchain_pid=$!

# 2. Python: a venv of the pinned third-party packages, shared by every checkout (keyed by the pins),
# and this checkout's own layer over it (keyed by its path): whatever runs from the layer imports this
# checkout's code, never another's (docs/local-cluster.md). Each is built once, under a lock, marked
# complete at its end, and built again if a run finds it incomplete.
deps=$(python3 "$repo/scripts/venvs.py" deps)
layer=$(python3 "$repo/scripts/venvs.py" checkout --deps "$deps")
export PDFLEET_VENV=$layer
export PATH="$layer/bin:$deps/bin:$PATH"

# 3. The control plane, built from Go modules into the versioned cache (under its lock too).
wait "$toolchain_pid" || say "the toolchain build beside pip failed (its error is above); building it again"
"$layer/bin/pdfleet" dev build >/dev/null
say "ready: $("$layer/bin/pdfleet" --version); shared venv $deps, layer $layer, toolchain $("$layer/bin/python" -c 'from pdfleet_devcluster.toolchain import toolchain_dir; print(toolchain_dir())')"
