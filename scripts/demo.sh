#!/usr/bin/env bash
# The README's main job: set up (idempotently), then run `pdfleet demo`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
. scripts/setup.sh
exec pdfleet demo "$@"
