"""images/build.sh: the daemonless image builds (debootstrap + pip + umoci + skopeo).

Opt-in (``PDFLEET_BUILD_IMAGES=1``; needs root and the network to Debian and PyPI): a cold operator
build takes about 2 minutes on 2 cores, a cached one seconds. Each test builds (or finds cached),
checks the image config the chart relies on (user, entrypoint), and that the entrypoint ran.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pdfleet_devcluster import toolchain
from pdfleet_operator import __version__

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PDFLEET_BUILD_IMAGES") != "1",
                       reason="image builds are opt-in: PDFLEET_BUILD_IMAGES=1 (root, network, ~2 min cold)"),
]

BUILD = Path(__file__).resolve().parents[3] / "images" / "build.sh"


def _build(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _config(archive: Path) -> dict:
    out = subprocess.run(["skopeo", "inspect", "--config", f"oci-archive:{archive}"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return json.loads(out)["config"]


@pytest.mark.parametrize(
    ("args", "name", "uid", "version_line"),
    [
        (("operator",), "operator", "65532", f"pdfleet-operator {__version__}"),
        (("runtime-cpu", "--torch-index", "none"), "runtime-cpu-notorch", "1000", f"pdfleet-runtime {__version__}"),
    ],
)
def test_image_builds_and_its_entrypoint_starts(args: tuple[str, ...], name: str, uid: str,
                                                version_line: str) -> None:
    proc = _build(*args)
    assert proc.stdout.strip().splitlines()[-1] == version_line
    archive = toolchain.cache_root() / "images" / "out" / f"pdfleet-{name}-{__version__}.oci.tar"
    config = _config(archive)
    assert config["User"] == f"{uid}:{uid}"
    assert config["Entrypoint"] == [version_line.split()[0]]
    again = _build(*args)  # idempotent: the same inputs are found in the cache
    assert "is cached" in again.stderr and again.stdout.strip().splitlines()[-1] == version_line
