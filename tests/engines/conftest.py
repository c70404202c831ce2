"""Fixtures of the two-process engine tests: one target/initiator pair per engine configuration.

Each pair runs all scenarios of its module once (spawning costs seconds on a 2-core host); every
test then asserts on its scenario's result. Tests skip where the engine is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from pdfleet_runtime.engines import EngineConfig
from tests.engines.harness import run_pair


def require(module: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        message = f"{module} is not installed (pip install -e '.[engines]')"
        # scripts/test.sh installs the engines and sets this: there a missing engine is a failure.
        if os.environ.get("PDFLEET_REQUIRE_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)


def results_for(config: EngineConfig, scenarios: list[str]) -> dict[str, Any]:
    results = run_pair(config, scenarios)
    assert "error" not in results["setup"], results["setup"]["error"]
    return results


def scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    """One scenario's result; a scenario that raised fails the test with its traceback."""
    r = results[name]
    assert "error" not in r, r["error"]
    return r
