#!/usr/bin/env bash
# A cached virtualenv holding SGLang and what its parser and start-up hooks need on a CPU
# machine, keyed by the pins in scripts/sglang/ (so CI caches it with the other venvs).
# Idempotent: prints the venv's path; builds it first when missing (about 3.5 minutes cold), under a
# lock, marked complete at its end, retried once on a failure (scripts/venvs.py).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec python3 "$repo/scripts/venvs.py" sglang
