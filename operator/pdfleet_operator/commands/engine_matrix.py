"""`pdfleet matrix --engine sglang==0.5.23`: an engine version's rules, protocol table and owned flags."""

from __future__ import annotations

import sys

from pdfleet_runtime.engine_rules import engine_rule_table, known_versions
from pdfleet_runtime.engine_rules import vllm as vllm_rules
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.sglang import OWNED_FLAGS, PROTOCOLS, STAGING_BUFFER_ENV
from pdfleet_runtime.engine_rules.vllm_render import kv_transfer_config, transfer_env

__all__ = ["engine_json", "engine_text", "parse_engine"]


def parse_engine(text: str) -> tuple[str, str] | None:
    """``KIND==VERSION`` -> (kind, version) when this operator knows it; else prints why and returns None."""
    kind, sep, version = text.partition("==")
    if not sep or kind not in ("sglang", "vllm") or version not in known_versions(kind):
        known = ", ".join(f"{k}=={v}" for k in ("sglang", "vllm") for v in known_versions(k))
        print(f"error: unknown engine {text!r}; known: {known}", file=sys.stderr)
        return None
    return kind, version


def _owned(kind: str, version: str) -> list[tuple[str, str]]:
    fs = flag_set(kind, version)
    assert fs is not None
    owned = vllm_rules.OWNED_FLAGS if kind == "vllm" else OWNED_FLAGS
    return [(", ".join(f.option for f in fs.flags.values() if f.dest == dest) or dest, owner.format(role="spec.<role>"))
            for dest, owner in owned.items()]


def _vllm_text(version: str) -> str:
    fs = flag_set("vllm", version)
    lines = [f"engine vllm=={version}: {len(fs.flags) if fs else 0} option strings (from vLLM's parser)", "",
             "rules (config: vllm serve refuses it; silent: vLLM accepts and PD is lost or start fails; gpu-worker: "
             "the GPU worker refuses it; pair: every handshake fails) [confirmed by running vLLM's code | read]:"]
    for r in engine_rule_table("vllm", version):
        tag = " (warning)" if r["severity"] == "warning" else ""
        how = f" [{r['confirmed']}]" if "confirmed" in r else ""
        lines.append(f"  {r['id']}{tag} [{r['when']}]{how}: {r['title']}")
        lines.append(f"      why: {r['reason']}")
        lines.append(f"      fix: {r['fix']}")
        if r["source"] != "pdfleet":
            lines.append(f"      source: {r['source']}")
    lines += ["", "backend x protocol -> --kv-transfer-config (prefill) and environment:"]
    for (b, p) in vllm_rules.PROTOCOLS:
        env = " ".join(f"{k}={v}" for k, v in transfer_env(b, p, None))
        lines.append(f"  {p.value:<7} {b.value:<9} {kv_transfer_config(b, p, 'prefill')}  {env}")
    lines += ["", "flags the operator owns (denied in args):"]
    lines += [f"  {f}: {o}" for f, o in _owned("vllm", version)]
    lines += ["", "environment the operator owns (denied in env):"]
    lines += [f"  {n}: {o}" for n, o in vllm_rules.OWNED_ENV.items()]
    return "\n".join(lines)


def engine_json(kind: str, version: str) -> dict[str, object]:
    fs = flag_set(kind, version)
    if kind == "vllm":
        return {"engine": kind, "version": version, "flags": len(fs.flags) if fs else 0,
                "rules": engine_rule_table(kind, version),
                "protocols": [{"backend": str(b), "protocol": str(p), "kvTransferConfig": kv_transfer_config(b, p, r),
                               "role": r, "env": dict(transfer_env(b, p, None))}
                              for (b, p) in vllm_rules.PROTOCOLS for r in ("prefill", "decode")],
                "ownedFlags": [{"flags": f, "owner": o} for f, o in _owned(kind, version)],
                "ownedEnv": dict(vllm_rules.OWNED_ENV)}
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
    if kind == "vllm":
        return _vllm_text(version)
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
