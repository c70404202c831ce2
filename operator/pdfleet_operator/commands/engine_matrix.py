"""`pdfleet matrix --engine sglang==0.5.23`: an engine version's rules, protocol table and owned flags."""

from __future__ import annotations

import sys

from pdfleet_runtime.engine_rules import engine_rule_table, known_versions
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.sglang import OWNED_FLAGS, PROTOCOLS, STAGING_BUFFER_ENV

__all__ = ["engine_json", "engine_text", "parse_engine"]


def parse_engine(text: str) -> tuple[str, str] | None:
    """``KIND==VERSION`` -> (kind, version) when this operator knows it; else prints why and returns None."""
    kind, sep, version = text.partition("==")
    if not sep or kind != "sglang" or version not in known_versions(kind):
        known = ", ".join(f"sglang=={v}" for v in known_versions("sglang"))
        print(f"error: unknown engine {text!r}; known: {known}", file=sys.stderr)
        return None
    return kind, version


def _owned(kind: str, version: str) -> list[tuple[str, str]]:
    fs = flag_set(kind, version)
    assert fs is not None
    return [(", ".join(f.option for f in fs.flags.values() if f.dest == dest), owner.format(role="spec.<role>"))
            for dest, owner in OWNED_FLAGS.items()]


def engine_json(kind: str, version: str) -> dict[str, object]:
    fs = flag_set(kind, version)
    return {
        "engine": kind,
        "version": version,
        "flags": len(fs.flags) if fs else 0,
        "rules": engine_rule_table(kind, version),
        "protocols": [{"backend": str(b), "protocol": str(p), "transferBackend": s.backend_flag, "env": dict(s.env),
                       "ibDevice": s.ib_device, "hostIPC": s.host_ipc, "note": s.note}
                      for (b, p), s in PROTOCOLS.items()],
        "ownedFlags": [{"flags": f, "owner": o} for f, o in _owned(kind, version)],
    }


def engine_text(kind: str, version: str) -> str:
    fs = flag_set(kind, version)
    lines = [f"engine {kind}=={version}: {len(fs.flags) if fs else 0} flags (from the wheel's parser)", "",
             "rules (start-up: SGLang refuses the flags; transfer: the engine starts, the transfer fails):"]
    for r in engine_rule_table(kind, version):
        tag = " (warning)" if r["severity"] == "warning" else ""
        lines.append(f"  {r['id']}{tag} [{r['when']}]: {r['title']}")
        lines.append(f"      why: {r['reason']}")
        lines.append(f"      fix: {r['fix']}")
        if r["source"] != "pdfleet":
            lines.append(f"      source: {r['source']}")
    lines += ["", "protocol -> SGLang flags and environment:"]
    for (b, p), s in PROTOCOLS.items():
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        ib = " --disaggregation-ib-device" if s.ib_device else ""
        lines.append(f"  {p.value:<7} {b.value:<9} --disaggregation-transfer-backend {s.backend_flag}{ib}"
                     f"{'  ' + env if env else ''}{'  hostIPC' if s.host_ipc else ''}")
    lines.append(f"  spec.engine.stagingBuffer: {STAGING_BUFFER_ENV}=1 (mooncake and nixl)")
    lines += ["", "flags the operator owns (denied in args):"]
    lines += [f"  {f}: {o}" for f, o in _owned(kind, version)]
    return "\n".join(lines)
