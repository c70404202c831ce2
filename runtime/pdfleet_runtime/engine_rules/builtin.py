"""The built-in pdfleet runtime as an engine kind: nothing beside the pod to check.

Its runtime container is the engine, so admission has no flags, versions or engine rules to read
(``checked`` False: the operator's ``engine_input`` is None); it speaks sglang-router's PD protocol (the
bootstrap fields), and its parallelism cells say what the runtime's planner addresses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from pdfleet_runtime.engine_rules.contract import CheckHarness
from pdfleet_runtime.engine_rules.inputs import EngineInput
from pdfleet_runtime.engine_rules.parallel import ParallelCell
from pdfleet_runtime.links import Backend
from pdfleet_runtime.matrix import Violation

__all__ = ["BUILTIN", "BuiltinRules"]

_CELLS: tuple[ParallelCell, ...] = (
    ParallelCell("pdfleet", "attention-dp", None, False,
                 "the runtime's planner and wire protocol address ranks by (TP, PP) only: no DP rank, so no "
                 "decode DP rank -> prefill DP rank mapping", "builtin-no-attention-dp"),
    ParallelCell("pdfleet", "expert-parallel", None, False,
                 "the runtime moves attention and linear state only; it has no MoE layers",
                 "builtin-no-expert-parallel"),
    *(ParallelCell("pdfleet", "multi-node", b, True,
                   "a replica group: member m runs ranks [m * local, (m + 1) * local); the leader serves HTTP and "
                   "the bootstrap and drives its members' ranks over the group channel (signed with the role's "
                   "group key)") for b in (Backend.MOONCAKE, Backend.NIXL)),
)


class BuiltinRules:
    """``spec.engine.kind: pdfleet`` (or no ``spec.engine``)."""

    kind = "pdfleet"
    own_router = "sglang"  # the runtime's prefill answers sglang-router's bootstrap fields
    # ... and vLLM's kv_transfer_params (pod.vllm_contract): NIXL's two steps, Mooncake's one
    routers = frozenset({"sglang", "vllm"})
    checked = False
    harness: CheckHarness | None = None
    owned_flags: Mapping[str, str] = MappingProxyType({})
    parallel_cells: Sequence[ParallelCell] = _CELLS

    def known_versions(self) -> tuple[str, ...]:
        return ()

    def table_env(self, inp: EngineInput) -> list[tuple[str, str, str]]:
        return []

    def evaluate(self, inp: EngineInput) -> list[Violation]:
        return []

    def rule_rows(self, version: str) -> list[dict[str, str]]:
        return []

    def matrix_text(self, version: str) -> str:
        return ""

    def matrix_json(self, version: str) -> dict[str, object]:
        return {}


BUILTIN = BuiltinRules()
