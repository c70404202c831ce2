"""Run rendered engine commands through SGLang itself (check_server_args.py in the SGLang venv).

``sglang_python()`` is the venv's interpreter, built through scripts/sglang-venv.sh (idempotent, cached
by its pins; scripts/test.sh exports PDFLEET_SGLANG_PYTHON). ``run_cases`` runs the checker under a
private mount namespace whose ``/sys/class`` is a tmpfs with ``infiniband/<device>`` entries: sysfs
refuses mkdir, and SGLang's Mooncake IB check lists that directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKER = Path(__file__).resolve().parent / "check_server_args.py"
IB_DEVICES = tuple(f"mlx5_{i}" for i in range(8))  # the fake node's InfiniBand devices
CHECK_ONLY = ["--load-format", "dummy", "--device", "cuda"]  # added for the check, never rendered


@cache
def sglang_python() -> str:
    found = os.environ.get("PDFLEET_SGLANG_PYTHON")
    if found:
        return found
    venv = subprocess.run(["bash", str(REPO / "scripts" / "sglang-venv.sh")], check=True, text=True,
                          stdout=subprocess.PIPE).stdout.strip()
    return f"{venv}/bin/python"


def _namespace_argv(script: str) -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private", "--", "sh", "-ec", script]


def run_cases(cases: list[dict], ib_devices: tuple[str, ...] = IB_DEVICES, timeout: float = 1500) -> dict:
    """{"results": {id: {"ok", "type", "message", "where"}}, "import_s", "cases_s"} from SGLang."""
    with tempfile.TemporaryDirectory(prefix="sglang-check-") as tmp:
        cases_file, results_file = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        cases_file.write_text(json.dumps(cases))
        mkdirs = " ".join(f"/sys/class/infiniband/{d}" for d in ib_devices)
        script = (f"mount -t tmpfs tmpfs /sys/class && mkdir -p {mkdirs} && "
                  f"exec {sglang_python()} {CHECKER} {cases_file} {results_file}")
        proc = subprocess.run(_namespace_argv(script), capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(results_file.read_text())
