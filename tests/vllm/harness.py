"""Run rendered `vllm serve` commands through vLLM itself (check_vllm.py in the vLLM venv).

``vllm_python()`` is the venv's interpreter: ``PDFLEET_VLLM_PYTHON`` (scripts/test.sh exports it from
scripts/vllm-venv.sh), else the cached venv when it is complete. Without it the tests skip with the reason,
except under ``PDFLEET_REQUIRE_ENGINES=1`` (scripts/test.sh, CI), where they fail. ``run_cases`` builds the
stand-in libcuda with the machine's gcc and runs the checker once for all cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKER = Path(__file__).resolve().parent / "check_vllm.py"
STUB = Path(__file__).resolve().parent / "shims" / "libcuda_stub.c"
CHECK_ONLY = ["--load-format", "dummy"]  # added for the check (no weights), never rendered


def vllm_python() -> str:
    found = os.environ.get("PDFLEET_VLLM_PYTHON")
    if found:
        return found
    if os.environ.get("PDFLEET_REQUIRE_ENGINES") == "1":
        venv = subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh")], check=True, text=True,
                              stdout=subprocess.PIPE).stdout.strip()
        return f"{venv}/bin/python"
    venv = venv_path()
    if not (venv / ".complete").is_file():
        pytest.skip(f"the vLLM check venv {venv} is not built (bash scripts/vllm-venv.sh: ~6 min, 9.5 GB; "
                    "PDFLEET_REQUIRE_ENGINES=1 builds it and makes a missing venv a failure)")
    return str(venv / "bin" / "python")


def venv_path() -> Path:
    """Where scripts/vllm-venv.sh keeps the venv of the current pins (the same key: the pins, then the
    Python version as ``sys.version_info[:2]`` prints it)."""
    cache = Path(os.environ.get("PDFLEET_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "pdfleet")
    pins = (REPO / "scripts" / "vllm" / "requirements.txt").read_bytes()
    return cache / f"vllm-venv-{hashlib.sha256(pins + b'(3, 11)' + bytes([10])).hexdigest()[:12]}"


def run_cases(cases: list[dict], timeout: float = 1800) -> dict:
    """{"results": {id: {...}}, "import_s", "cases_s"} from vLLM."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-check-") as tmp:
        libcuda = Path(tmp) / "libcuda.so.1"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(libcuda),
                        str(STUB)], check=True, capture_output=True, timeout=120)
        cases_file, results_file = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        cases_file.write_text(json.dumps(cases))
        proc = subprocess.run([python, str(CHECKER), str(libcuda), str(cases_file), str(results_file)],
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(results_file.read_text())
