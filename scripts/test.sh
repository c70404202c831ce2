#!/usr/bin/env bash
# The README's test command: set up (idempotently), then lint, check import
# layers, and run every test, the cluster tests against a real control plane.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
. scripts/setup.sh
echo "[test] ruff"; ruff check operator runtime tests bench
echo "[test] import-linter"; lint-imports --no-cache
echo "[test] mypy"; mypy  # the checked modules and settings: pyproject.toml [tool.mypy]
echo "[test] pytest"
# GPU tests run on the device machine only; here they are skipped with that reason.
# Two workers, whole files each (module fixtures stay together); each worker starts its own
# control plane. Most cluster tests wait on the API, so two workers on 2 cores nearly halve the time.
export PDFLEET_REQUIRE_ENGINES=1
# SGLang's own parser and start-up hooks check the rendered engine commands (tests/sglang): a venv of
# its own, cached by the pins in scripts/sglang/ (about 2-3.5 minutes and 6 GB the first time).
echo "[test] sglang venv"
PDFLEET_SGLANG_PYTHON="$(bash scripts/sglang-venv.sh)/bin/python"
export PDFLEET_SGLANG_PYTHON
# vLLM's own parser, config and connector code check the rendered vLLM commands (tests/vllm): its own venv,
# cached by the pins in scripts/vllm/ (about 6 minutes and 9.5 GB the first time).
echo "[test] vllm venv"
PDFLEET_VLLM_PYTHON="$(bash scripts/vllm-venv.sh)/bin/python"
export PDFLEET_VLLM_PYTHON
exec python -m pytest -p no:cacheprovider -n 2 --dist loadfile "$@"
