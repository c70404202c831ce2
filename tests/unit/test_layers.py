"""The architecture's import layers hold (import-linter contracts in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 7 kept, 0 broken" in proc.stdout


def test_no_top_level_operator_package() -> None:
    # `operator/` is a folder, not a package: it must never shadow the stdlib module.
    assert not (REPO / "operator" / "__init__.py").exists()
    import operator

    assert operator.__file__ is not None and "pdfleet" not in operator.__file__
    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("module", ["pdfleet_operator.cli", "pdfleet_runtime"])
def test_console_modules_print_help(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
