"""A decode engine configured to skip receiving state (issue 46): the fault made on the data path, through the
spec a user writes, and every layer that must catch it. A vLLM-contract fleet of real runtime pods behind
vllm-router (NIXL's two steps), scraped by a real Prometheus with the chart's rules:

- healthy, with chat traffic through the router: `pdfleet doctor` passes;
- the decode role's engine then runs without its KV connector (``PDFLEET_KV_CONNECTOR=none`` in
  ``spec.decode.env``, as an engine started without ``--kv-transfer-config``): the rollout completes (the canary
  proves the path, so the gates open) and every request is still answered, but no state moves; the decodes
  recompute prompts and the prefill's state expires unclaimed;
- what says so: the doctor exits 1 naming ``state-received`` on each new decode and ``unclaimed-state`` on the
  prefill, with their fixes; each of those pods raises ``pdfleet.io/silent-fallback`` and the PDDeployment turns
  ``Degraded`` (``SilentFallback``) naming them, with a warning event; and ``promtool test rules``, over the
  series this Prometheus scraped during the run (each 5 s step replayed as a minute), fires
  ``PdfleetSilentFallback`` on those pods and ``PdfleetDecodeAnsweredWithoutState`` on the decodes.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.prometheus import promtool_test, replayed_rule_test, rules, running_prometheus
from tests.e2e.test_doctor_runtimes import _doctor
from tests.e2e.traffic import IMAGE, NAME, manifest, running_fleet

pytestmark = pytest.mark.cluster

FLEET = {"router_kind": "vllm", "backend": "nixl", "canary_period": 2}
STEP_S = 5.0
FAULT_S = 110.0  # >= 15 replayed minutes: rate5m then `for: 10m` of PdfleetDecodeAnsweredWithoutState
RECOMPUTE_COST = {"prefillSecondsPerPromptToken": 0.002, "decodeSecondsPerToken": 0.001}
SCRAPED = ["pdfleet_silent_fallbacks_total", "sglang:num_requests_total", "pdfleet_transfers_total"]


def _expected(alert: str, labels: dict[str, str]) -> dict:
    """One alert as promtool must see it: ``labels`` with the rule's own labels, and the rule's annotations with
    ``{{ $labels.X }}`` filled in (these rules' annotations use nothing else)."""
    [rule] = [r for r in rules() if r.get("alert") == alert]
    def fill(text: str) -> str:
        assert "{{" not in re.sub(r"\{\{ \$labels\.(\w+) \}\}", "", text), text
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
    return {"exp_labels": {**rule.get("labels", {}), **labels},
            "exp_annotations": {k: fill(v) for k, v in rule.get("annotations", {}).items()}}


def _silent_alerts(namespace: str, decodes: list[str], prefill: str) -> list[dict]:
    def pod(name: str, **more: str) -> dict[str, str]:
        return {"namespace": namespace, "pdfleet_deployment": NAME, "pod": name, **more}

    fallbacks = [pod(d, pdfleet_role="decode", reason="no_state_received") for d in sorted(decodes)]
    fallbacks.append(pod(prefill, pdfleet_role="prefill", reason="unclaimed_state"))
    return [{"alertname": "PdfleetSilentFallback",
             "exp_alerts": [_expected("PdfleetSilentFallback", labels) for labels in fallbacks]},
            {"alertname": "PdfleetDecodeAnsweredWithoutState",
             "exp_alerts": [_expected("PdfleetDecodeAnsweredWithoutState", pod(d)) for d in sorted(decodes)]}]


def test_a_decode_that_recomputes_is_caught_by_the_doctor_the_condition_and_the_alerts(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    # rooms no decode claims are freed after 2 s, so the prefill's table never fills: the fault stays silent
    with running_fleet(cluster, namespace, tmp_path / "pods", image_args={IMAGE: ("--room-ttl", "2")},
                       **FLEET) as fleet, \
            running_prometheus(tmp_path / "prometheus", fleet.core, namespace, f"127.0.0.1:{operator.metrics_port}") \
            as prom:
        healthy = fleet.chat_traffic(concurrency=2).start()
        fleet.wait(lambda: sum(a.ok for a in healthy.answers) >= 6, 60, "answers through vllm-router")
        rc, report = _doctor(cluster, namespace, "--window", "3")
        assert rc == 0, json.dumps([c for c in report["checks"] if c["verdict"] != "ok"], indent=1)[:3000]
        healthy.stop()
        assert not healthy.failures(), healthy.failures()[:3]

        old = set(fleet.runner.decode_pods())
        spec = manifest(namespace, **FLEET)["spec"]
        spec["decode"]["env"] += [{"name": "PDFLEET_KV_CONNECTOR", "value": "none"},
                                  # recomputing a prompt costs the decode the prefill's compute, as on an engine
                                  {"name": "PDFLEET_COMPUTE_COST", "value": json.dumps(RECOMPUTE_COST)}]
        # What a client sees: every request answered (a plain client cannot tell a recomputed answer).
        client = fleet.chat_traffic(concurrency=2, verify=None).start()
        fault_start = time.time()
        fleet.patch(spec)
        fleet.wait(lambda: fleet.available() and len(fleet.runner.decode_pods()) == 2
                   and not set(fleet.runner.decode_pods()) & old, 240, "the decodes rolled onto the new setting")
        decodes = sorted(fleet.runner.decode_pods())
        [prefill] = fleet.runner.running("prefill")
        rolled = time.time()

        def degraded() -> dict | None:
            cond = fleet.conditions().get("Degraded") or {}
            text = cond.get("message") or ""
            named = all(f"decode pod {d}: NoStateReceived" in text for d in decodes) \
                and f"prefill pod {prefill}: UnclaimedState" in text
            return cond if cond.get("status") == "True" and named else None

        cond = fleet.wait(degraded, 90, "Degraded naming both decodes and the prefill")
        print("Degraded:", cond["reason"], cond["message"][:600], flush=True)
        assert cond["reason"] == "SilentFallback", cond
        warned = [e for e in fleet.events() if e.get("reason") == "SilentFallback" and e.get("type") == "Warning"]
        assert warned and "silent fallback" in warned[0]["message"], [e.get("reason") for e in fleet.events()]

        rc, report = _doctor(cluster, namespace, "--window", "10")
        bad = {(c["check"], c["subject"]): c for c in report["checks"] if c["verdict"] == "fail"}
        print("doctor, decodes without their KV connector:", [(k, c["detail"]) for k, c in bad.items()], flush=True)
        assert rc == 1
        for d in decodes:
            assert ("state-received", d) in bad and "recomputes prompts" in bad[("state-received", d)]["detail"]
            assert "kv_consumer" in bad[("state-received", d)]["fix"]
        assert ("unclaimed-state", prefill) in bad, bad
        ok = {(c["check"], c["subject"]) for c in report["checks"] if c["verdict"] == "ok"}
        assert {("transfer-path", d) for d in decodes} <= ok  # the gates alone read healthy

        time.sleep(max(0.0, rolled + FAULT_S - time.time()))
        end = time.time()
        test = replayed_rule_test(prom, SCRAPED, namespace, fault_start - 60, end, STEP_S,
                                  _silent_alerts(namespace, decodes, prefill))
        out = promtool_test(test, tmp_path)
        answers = client.stop()
        assert out.returncode == 0 and "SUCCESS" in out.stdout, (out.stdout + out.stderr)[-4000:]
        failed = [a for a in answers if not a.ok]
        print(f"fault phase: {len(answers)} requests, {len(failed)} failed; replayed "
              f"{len(test['tests'][0]['input_series'])} series over {int((end - fault_start + 60) // STEP_S)} steps",
              flush=True)
        assert not failed, [a.problem for a in failed[:5]]  # silent: nothing failed for the client
        recomputed = [a for a in answers if a.pdfleet.get("recomputed")]
        assert recomputed and all(a.bytes == 0 for a in recomputed)
