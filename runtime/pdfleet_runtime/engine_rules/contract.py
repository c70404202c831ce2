"""The contract of an engine kind's rules: what admission, ``pdfleet matrix`` and the check harness ask of it.

One implementation per ``spec.engine.kind`` (``builtin``, ``sglang_plugin``, ``vllm_plugin``), found by kind
in ``registry``; the generic code (``engine_rules.evaluate_engine``, the operator's validation and its
``pdfleet matrix --engine``) calls these methods and never names an engine. Adding an engine adds a module
here and a line in ``registry``, not a branch.

The seam's types: ``EngineInput`` in (one spec's engine per role), ``Violation`` and plain rows out, and the
pydantic ``CheckHarness`` naming where the engine's own code checks the rules (tests/<kind>, run in a venv
built by ``scripts/venvs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from pdfleet_runtime.engine_rules.inputs import EngineInput
from pdfleet_runtime.engine_rules.parallel import ParallelCell
from pdfleet_runtime.matrix import Violation

__all__ = ["CheckHarness", "EngineRules"]


class CheckHarness(BaseModel):
    """Where the engine's own code checks these rules: the tests that run it, in the venv that holds it.
    Not run by the unit suite (the venvs are gigabytes); ``python3 scripts/venvs.py VENV`` builds one."""

    model_config = ConfigDict(frozen=True)

    venv: str  # scripts/venvs.py's name for the check venv
    tests: str  # the test directory, from the repository root
    pins: str  # what the venv pins: KIND==VERSION


class EngineRules(Protocol):
    """An engine kind as the rules see it. ``checked`` False: nothing beside the pod to check (the built-in
    runtime), so ``engine_input`` is None and only ``own_router`` and ``parallel_cells`` are read."""

    @property
    def kind(self) -> str:
        """``spec.engine.kind``."""
        ...

    @property
    def own_router(self) -> str:
        """The ``spec.router.kind`` whose PD protocol this engine speaks (the default when unset)."""
        ...

    @property
    def routers(self) -> frozenset[str]:
        """Every ``spec.router.kind`` whose PD protocol this engine speaks (``own_router`` among them)."""
        ...

    @property
    def checked(self) -> bool: ...

    @property
    def harness(self) -> CheckHarness | None: ...

    @property
    def owned_flags(self) -> Mapping[str, str]:
        """Flag dest -> the spec field that renders it (``{role}``: spec.prefill or spec.decode); denied in args."""
        ...

    @property
    def parallel_cells(self) -> Sequence[ParallelCell]: ...

    def known_versions(self) -> tuple[str, ...]:
        """Versions with rules and a flag set (``engine-version-unknown`` lists them)."""
        ...

    def table_env(self, inp: EngineInput) -> list[tuple[str, str, str]]:
        """(name, value, field path) the spec renders into the engine container, before the user's env."""
        ...

    def evaluate(self, inp: EngineInput) -> list[Violation]:
        """The engine's own errors: protocol table, versions, unknown and owned flags, the version's rules.
        The generic checks (the router's kind, the model download warning) are ``evaluate_engine``'s."""
        ...

    def rule_rows(self, version: str) -> list[dict[str, str]]:
        """The version's own rules as rows (``pdfleet matrix --engine``), after the general ones."""
        ...

    def matrix_text(self, version: str) -> str:
        """``pdfleet matrix --engine KIND==VERSION``."""
        ...

    def matrix_json(self, version: str) -> dict[str, object]:
        """``pdfleet matrix --engine KIND==VERSION --json``."""
        ...
