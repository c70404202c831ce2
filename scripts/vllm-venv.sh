#!/usr/bin/env bash
# A cached virtualenv holding vLLM 0.33.0 and vllm-router 0.1.17 with every dependency pinned
# (scripts/vllm/requirements.txt), for the check harness in tests/vllm (docs/vllm.md). Keyed by the pins
# and the Python version, so CI caches it with the other venvs. vLLM pins torch 2.14.0 and SGLang 2.14.1:
# a venv of its own. Idempotent: prints the venv's path; builds it first when missing (about 5 minutes,
# 4.6 GB of downloads and a 9.5 GB venv on a cold pip cache), under a lock, marked complete at its end,
# retried once on a failure (scripts/venvs.py).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec nice -n 10 python3 "$repo/scripts/venvs.py" vllm
