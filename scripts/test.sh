#!/usr/bin/env bash
# The README's test command: set up (idempotently), then lint, check import
# layers, and run every test, the cluster tests against a real control plane.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# SGLang's and vLLM's check venvs (tests/sglang, tests/vllm) and grafanalib's build in the background while
# set-up builds the shared venv and the toolchain and the linters run: pip's downloads and unpacking beside
# Go's compile (about 5 minutes saved cold; nothing when cached). Each is cached by its pins in scripts/sglang/ and
# scripts/vllm/ (about 2-3.5 and 4-6 minutes and 6 and 9.5 GB the first time).
checks=$(mktemp -d)
checks_pid=
# On any exit before they finish, the builds' whole process group goes (pip under them included); an
# interrupted build is made again on the next run (scripts/venvs.py marks a venv complete at its end).
trap '[ -z "$checks_pid" ] || kill -- "-$checks_pid" 2>/dev/null || true; rm -rf "$checks"' EXIT
# grafanalib's small venv (tests/unit/monitoring/test_dashboard.py) too: the test workers run inside the run's
# private network namespace (tests/conftest.py), where pip cannot reach the package index.
check_venvs='bash scripts/sglang-venv.sh >"$0/sglang" && bash scripts/vllm-venv.sh >"$0/vllm" && python3 scripts/venvs.py grafana >/dev/null'
if command -v python3 >/dev/null && command -v setsid >/dev/null; then
  setsid bash -c "$check_venvs" "$checks" & checks_pid=$!
fi
. scripts/setup.sh
echo "[test] ruff"; ruff check operator runtime tests bench
echo "[test] import-linter"; lint-imports --no-cache
echo "[test] mypy"; mypy  # the checked modules and settings: pyproject.toml [tool.mypy]
# GPU tests run on the device machine only; here they are skipped with that reason.
# Two workers, whole files each (module fixtures stay together); each worker starts its own
# control plane. Most cluster tests wait on the API, so two workers on 2 cores nearly halve the time.
export PDFLEET_REQUIRE_ENGINES=1
echo "[test] waiting for the SGLang and vLLM check venvs"
if [ -n "$checks_pid" ]; then wait "$checks_pid"; else bash -c "$check_venvs" "$checks"; fi
checks_pid=
PDFLEET_SGLANG_PYTHON="$(cat "$checks/sglang")/bin/python"
PDFLEET_VLLM_PYTHON="$(cat "$checks/vllm")/bin/python"
export PDFLEET_SGLANG_PYTHON PDFLEET_VLLM_PYTHON
echo "[test] pytest"
python -m pytest -p no:cacheprovider -n 2 --dist loadfile --durations=25 "$@"
