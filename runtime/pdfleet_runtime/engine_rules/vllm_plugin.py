"""vLLM as an engine kind (``EngineRules``): its rules, connector table, owned flags and env, check harness.

The data lives in ``vllm`` (tables and rules), the evaluation in ``vllm_eval`` and what the spec renders in
``vllm_render``; this module is what the registry hands the generic code, and the text ``pdfleet matrix
--engine vllm==VERSION`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdfleet_runtime.engine_rules import vllm
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.common import general_rule_rows, owned_flag_rows
from pdfleet_runtime.engine_rules.contract import CheckHarness
from pdfleet_runtime.engine_rules.inputs import EngineInput
from pdfleet_runtime.engine_rules.parallel import ParallelCell
from pdfleet_runtime.engine_rules.vllm_eval import (
    evaluate_vllm,
    known_vllm_versions,
    vllm_rule_rows,
    vllm_table_env,
)
from pdfleet_runtime.engine_rules.vllm_render import kv_transfer_config, transfer_env
from pdfleet_runtime.matrix import Violation

__all__ = ["VLLM", "VllmRules"]


class VllmRules:
    """``spec.engine.kind: vllm``."""

    kind = "vllm"
    own_router = "vllm"  # vllm-router sends vLLM's kv_transfer_params
    routers = frozenset({"vllm"})
    checked = True
    harness: CheckHarness | None = CheckHarness(venv="vllm", tests="tests/vllm", pins="vllm==0.33.0")
    owned_flags: Mapping[str, str] = vllm.OWNED_FLAGS
    parallel_cells: Sequence[ParallelCell] = ()

    def known_versions(self) -> tuple[str, ...]:
        return known_vllm_versions()

    def table_env(self, inp: EngineInput) -> list[tuple[str, str, str]]:
        return vllm_table_env(inp)

    def evaluate(self, inp: EngineInput) -> list[Violation]:
        return evaluate_vllm(inp)

    def rule_rows(self, version: str) -> list[dict[str, str]]:
        return vllm_rule_rows(version)

    def matrix_json(self, version: str) -> dict[str, object]:
        fs = flag_set(self.kind, version)
        return {"engine": self.kind, "version": version, "flags": len(fs.flags) if fs else 0,
                "rules": general_rule_rows() + self.rule_rows(version),
                "protocols": [{"backend": str(b), "protocol": str(p), "kvTransferConfig": kv_transfer_config(b, p, r),
                               "role": r, "env": dict(transfer_env(b, p, None))}
                              for (b, p) in vllm.PROTOCOLS for r in ("prefill", "decode")],
                "ownedFlags": [{"flags": f, "owner": o}
                               for f, o in owned_flag_rows(self.kind, version, self.owned_flags)],
                "ownedEnv": dict(vllm.OWNED_ENV)}

    def matrix_text(self, version: str) -> str:
        fs = flag_set(self.kind, version)
        lines = [f"engine vllm=={version}: {len(fs.flags) if fs else 0} option strings (from vLLM's parser)", "",
                 "rules (config: vllm serve refuses it; silent: vLLM accepts and PD is lost or start fails; "
                 "gpu-worker: the GPU worker refuses it; pair: every handshake fails) [confirmed by running vLLM's "
                 "code | read]:"]
        for r in general_rule_rows() + self.rule_rows(version):
            tag = " (warning)" if r["severity"] == "warning" else ""
            how = f" [{r['confirmed']}]" if "confirmed" in r else ""
            lines.append(f"  {r['id']}{tag} [{r['when']}]{how}: {r['title']}")
            lines.append(f"      why: {r['reason']}")
            lines.append(f"      fix: {r['fix']}")
            if r["source"] != "pdfleet":
                lines.append(f"      source: {r['source']}")
        lines += ["", "backend x protocol -> --kv-transfer-config (prefill) and environment:"]
        for (b, p) in vllm.PROTOCOLS:
            env = " ".join(f"{k}={v}" for k, v in transfer_env(b, p, None))
            lines.append(f"  {p.value:<7} {b.value:<9} {kv_transfer_config(b, p, 'prefill')}  {env}")
        lines += ["", "flags the operator owns (denied in args):"]
        lines += [f"  {f}: {o}" for f, o in owned_flag_rows(self.kind, version, self.owned_flags)]
        lines += ["", "environment the operator owns (denied in env):"]
        lines += [f"  {n}: {o}" for n, o in vllm.OWNED_ENV.items()]
        return "\n".join(lines)


VLLM = VllmRules()
