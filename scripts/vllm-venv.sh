#!/usr/bin/env bash
# A cached virtualenv holding vLLM 0.33.0 and vllm-router 0.1.17 with every dependency pinned
# (scripts/vllm/requirements.txt), for the check harness in tests/vllm (docs/vllm.md). Keyed by the pins
# and the Python version, so CI caches it with the other venvs. vLLM pins torch 2.14.0 and SGLang 2.14.1:
# a venv of its own. Idempotent: prints the venv's path; builds it first when missing or incomplete
# (about 5 minutes and 4.6 GB of downloads on a cold pip cache, a 9.5 GB venv).
#
# Concurrent callers wait on a lock; the venv counts as built only once `.complete` is written at the
# very end (atomically: a rename), so an interrupted build is found incomplete and rebuilt. A failed
# build is retried once, after printing why it failed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfleet}
pins="$repo/scripts/vllm/requirements.txt"
say() { printf '[vllm-venv] %s\n' "$*" >&2; }
py=$(command -v python3.11 || command -v python3)
if [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 11))')" != True ]; then
  echo "error: the vLLM pins are resolved for CPython 3.11 (python3.11 is needed, found $("$py" -V))" >&2; exit 1
fi
key=$(cat "$pins" <("$py" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-12)
venv="$cache/vllm-venv-$key"
mkdir -p "$cache"

build() {
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # --no-deps is not used: pip checks the pinned set is consistent as it installs it
  nice -n 10 "$venv/bin/pip" install -q --progress-bar off --disable-pip-version-check -r "$pins"
  touch "$venv/.complete.tmp" && mv "$venv/.complete.tmp" "$venv/.complete"
}

if [ ! -f "$venv/.complete" ]; then
  exec 9>"$cache/vllm-venv-$key.lock"
  if ! flock -n 9; then
    say "another build of $venv is running: waiting for its lock"
    flock 9
  fi
  if [ ! -f "$venv/.complete" ]; then  # the holder may have built it while this one waited
    [ -d "$venv" ] && say "removing the incomplete $venv (an interrupted build)"
    say "building $venv from $(grep -c '^[^#].*==' "$pins") pins (vllm==0.33.0: minutes and GBs on a cold pip cache)"
    start=$(date +%s)
    log="$cache/vllm-venv-$key.log"
    if ! build >"$log" 2>&1; then
      say "build failed after $(($(date +%s) - start)) s; the last lines of its log ($log):"
      tail -n 20 "$log" >&2
      say "retrying once"
      start=$(date +%s)
      if ! build >"$log" 2>&1; then
        say "build failed again; the last lines of its log ($log):"
        tail -n 40 "$log" >&2
        exit 1
      fi
    fi
    say "built in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
  fi
  exec 9>&-
fi
echo "$venv"
