"""Render the chart with the helm binary built from Go modules (``pdfleet dev build``)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import toolchain

CHART = Path(__file__).resolve().parents[3] / "charts" / "pdfleet"
RELEASE, NAMESPACE = "rel", "pdfleet-system"

Render = Callable[..., list[dict]]


@pytest.fixture(scope="session")
def helm() -> Path:
    path = toolchain.binary("helm")
    if not path.exists():
        pytest.skip(f"helm is not built ({path}): run `pdfleet dev build` (scripts/setup.sh does)")
    return path


def helm_run(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def render(helm: Path) -> Render:
    """``render("a.b=1", ..., values={...})`` -> the rendered objects (``--set`` strings, a values dict)."""

    def _render(*sets: str, values: dict | None = None, tmp: Path | None = None) -> list[dict]:
        args = ["template", RELEASE, str(CHART), "-n", NAMESPACE]
        for s in sets:
            args += ["--set", s]
        if values is not None:
            assert tmp is not None, "a values dict needs tmp (a directory for the file)"
            f = tmp / "values.yaml"
            f.write_text(yaml.safe_dump(values))
            args += ["-f", str(f)]
        out = helm_run(helm, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    return _render


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]
