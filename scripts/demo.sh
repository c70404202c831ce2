#!/usr/bin/env bash
# The README's main job: set up (idempotently), build the project's Zen model (cached by its script's hash;
# about a minute the first time), then run `pdfleet demo` with it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
. scripts/setup.sh
model=$(python scripts/zen_model.py)
exec pdfleet demo --model "$model" "$@"
