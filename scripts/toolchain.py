"""Build (or find) the control plane's toolchain with nothing but the standard library.

``scripts/setup.sh`` starts it beside the shared venv's pip install, so Go's compile and pip's downloads overlap
on a cold machine (the toolchain's Python, ``pdfleet_devcluster/toolchain.py`` and
``pdfleet_operator/cachedbuild.py``, imports nothing else; the package ``pdfleet_devcluster`` itself needs the
venv, so the module is loaded by its path). Locked and idempotent like ``pdfleet dev build``, which set-up runs
after it all the same. It gets SIGTERM when the set-up that started it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    sys.path.insert(0, str(REPO / "operator"))  # pdfleet_operator.cachedbuild: the standard library only
    spec = importlib.util.spec_from_file_location("_pdfleet_toolchain", REPO / "operator/pdfleet_devcluster/toolchain.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return int(mod.main())


if __name__ == "__main__":
    raise SystemExit(main())
