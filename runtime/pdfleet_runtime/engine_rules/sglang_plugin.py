"""SGLang as an engine kind (``EngineRules``): its rules, protocol table, owned flags and check harness.

The data lives in ``sglang`` (tables and rules) and the evaluation in ``sglang_eval``; this module is what
the registry hands the generic code, and the text ``pdfleet matrix --engine sglang==VERSION`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdfleet_runtime.engine_rules import sglang
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.common import general_rule_rows, owned_flag_rows
from pdfleet_runtime.engine_rules.contract import CheckHarness
from pdfleet_runtime.engine_rules.inputs import EngineInput
from pdfleet_runtime.engine_rules.parallel import ParallelCell
from pdfleet_runtime.engine_rules.sglang_eval import (
    evaluate_sglang,
    known_sglang_versions,
    sglang_rule_rows,
    sglang_table_env,
)
from pdfleet_runtime.links import Backend
from pdfleet_runtime.matrix import Violation

__all__ = ["SGLANG", "SGLangRules"]

# What SGLang 0.5.23 does with attention DP, EP and replicas across nodes in PD, read from its
# disaggregation code: every connector (mooncake, nixl, mori) shares ``disaggregation/common/conn.py``'s
# bootstrap, which addresses the prefill side per attention DP rank (``prefill_dp_rank``; with the
# prefill's default ``--load-balance-method follow_bootstrap_room`` it is ``bootstrap_room % dp ranks``, so
# the router's random room picks it and no DP-aware router flag is needed). Each DP rank owns whole
# requests, so a request's state of every type moves between one prefill DP rank and one decode DP rank
# as at DP 1.
_TAG = "sglang==0.5.23"
_COMMON = "python/sglang/srt/disaggregation/common/conn.py"
_GROUPS = ("a replica group: nodesPerReplica pods, one per node, created, drained and restarted as a unit; "
           "--nnodes/--node-rank/--dist-init-addr through the group's headless Service; only the first pod "
           "serves HTTP and the bootstrap (docs/parallelism.md)")
_BACKENDS = (Backend.MOONCAKE, Backend.NIXL, Backend.MORI)
_CELLS: tuple[ParallelCell, ...] = (
    *(ParallelCell(_TAG, "attention-dp", b, True,
                   f"every state type, per DP rank: the shared bootstrap routes by prefill_dp_rank ({_COMMON})")
      for b in _BACKENDS),
    *(ParallelCell(_TAG, "expert-parallel", b, True,
                   "EP shards MoE weights only; transferred state is attention/linear state, unchanged by EP")
      for b in _BACKENDS),
    *(ParallelCell(_TAG, "multi-node", b, True, _GROUPS) for b in _BACKENDS),
)


class SGLangRules:
    """``spec.engine.kind: sglang``."""

    kind = "sglang"
    own_router = "sglang"
    routers = frozenset({"sglang"})
    checked = True
    harness: CheckHarness | None = CheckHarness(venv="sglang", tests="tests/sglang", pins="sglang==0.5.23")
    owned_flags: Mapping[str, str] = sglang.OWNED_FLAGS
    parallel_cells: Sequence[ParallelCell] = _CELLS

    def known_versions(self) -> tuple[str, ...]:
        return known_sglang_versions()

    def table_env(self, inp: EngineInput) -> list[tuple[str, str, str]]:
        return sglang_table_env(inp)

    def evaluate(self, inp: EngineInput) -> list[Violation]:
        return evaluate_sglang(inp)

    def rule_rows(self, version: str) -> list[dict[str, str]]:
        return sglang_rule_rows(version)

    def matrix_json(self, version: str) -> dict[str, object]:
        fs = flag_set(self.kind, version)
        return {
            "engine": self.kind,
            "version": version,
            "flags": len(fs.flags) if fs else 0,
            "rules": general_rule_rows() + self.rule_rows(version),
            "protocols": [{"backend": str(b), "protocol": str(p), "transferBackend": s.backend_flag,
                           "env": dict(s.env), "ibDevice": s.ib_device, "hostIPC": s.host_ipc, "note": s.note}
                          for (b, p), s in sglang.PROTOCOLS.items()],
            "ownedFlags": [{"flags": f, "owner": o} for f, o in owned_flag_rows(self.kind, version, self.owned_flags)],
        }

    def matrix_text(self, version: str) -> str:
        fs = flag_set(self.kind, version)
        lines = [f"engine {self.kind}=={version}: {len(fs.flags) if fs else 0} flags (from the wheel's parser)", "",
                 "rules (start-up: SGLang refuses the flags; transfer: the engine starts, the transfer fails):"]
        for r in general_rule_rows() + self.rule_rows(version):
            tag = " (warning)" if r["severity"] == "warning" else ""
            lines.append(f"  {r['id']}{tag} [{r['when']}]: {r['title']}")
            lines.append(f"      why: {r['reason']}")
            lines.append(f"      fix: {r['fix']}")
            if r["source"] != "pdfleet":
                lines.append(f"      source: {r['source']}")
        lines += ["", "protocol -> SGLang flags and environment:"]
        for (b, p), s in sglang.PROTOCOLS.items():
            env = " ".join(f"{k}={v}" for k, v in s.env.items())
            ib = " --disaggregation-ib-device" if s.ib_device else ""
            lines.append(f"  {p.value:<7} {b.value:<9} --disaggregation-transfer-backend {s.backend_flag}{ib}"
                         f"{'  ' + env if env else ''}{'  hostIPC' if s.host_ipc else ''}")
        lines.append(f"  spec.engine.stagingBuffer: {sglang.STAGING_BUFFER_ENV}=1 (mooncake and nixl)")
        lines += ["", "flags the operator owns (denied in args):"]
        lines += [f"  {f}: {o}" for f, o in owned_flag_rows(self.kind, version, self.owned_flags)]
        return "\n".join(lines)


SGLANG = SGLangRules()
