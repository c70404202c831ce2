#!/usr/bin/env bash
# A cached virtualenv holding SGLang and what its parser and start-up hooks need on a CPU
# machine, keyed by the pins in scripts/sglang/ (so CI caches it with the other venvs).
# Idempotent: prints the venv's path; builds it first when missing (about 3.5 minutes cold).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfleet}
pins="$repo/scripts/sglang"
py=$(command -v python3.11 || command -v python3)
if [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 11))')" != True ]; then
  echo "error: SGLang 0.5.23 ships a cp311 wheel only: python3.11 is needed (found $("$py" -V))" >&2; exit 1
fi
key=$(cat "$pins/requirements.txt" "$pins/engine.txt" <("$py" -c 'import sys; print(sys.version_info[:2])') \
  | sha256sum | cut -c1-12)
venv="$cache/sglang-venv-$key"
if [ ! -f "$venv/.complete" ]; then
  printf '[sglang-venv] creating %s (torch is a large wheel: minutes on a cold pip cache)\n' "$venv" >&2
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --progress-bar off -r "$pins/requirements.txt"
  "$venv/bin/pip" install -q --progress-bar off --no-deps -r "$pins/engine.txt"
  printf '[sglang-venv] built in %ss, %s\n' "$(($(date +%s) - start))" "$(du -sh "$venv" | cut -f1)" >&2
  touch "$venv/.complete"
fi
echo "$venv"
