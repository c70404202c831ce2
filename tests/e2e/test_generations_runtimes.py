"""Routers pair one generation at a time (issues 44 and 47; operator/pdfleet_operator/generations.py), with real
vllm-router and sglang-router in front of built-in runtime pods in the local cluster.

A change of the compatibility key (here the KV-cache dtype, bfloat16 -> float16: both roles roll, and a decode
refuses a prefill of the other dtype at its handshake, as vLLM's NIXL handshake does) rolls out under client
traffic through the router's Service:

- with generations (the default): zero client failures, zero router retries, zero failed transfers and zero
  handshake refusals; the router Deployment's selectors name one generation at every moment;
- the same rollout back with the operator's ``--no-router-generations``: the router pairs pods of both
  generations, the PDDeployment says so while it lasts (``Degraded``, ``GenerationsMixed``, naming the pods of
  each key; never in the rollout by generation), and those pairs fail: behind vllm-router the decodes refuse them at the handshake (the test fails
  if none is refused), behind sglang-router the prefill refuses to plan state of two dtypes (the test fails if
  nothing failed, or if any answer came from such a pair: answers name their prefill and decode).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import NAME, Fleet, Traffic, manifest, running_fleet

pytestmark = pytest.mark.cluster

LLAMA = {"numLayers": 32, "fullAttentionLayers": {"interval": 1}, "kvHeads": 8, "headDim": 128, "pageSize": 16}


def layout(dtype: str) -> dict:
    return {"layout": {"inline": {**LLAMA, "dtype": dtype}}}


def _router_deployment(fleet: Fleet) -> dict:
    return json.loads(fleet.cluster.kubectl("-n", fleet.ns, "get", "deployment", f"{NAME}-router", "-o",
                                            "json").stdout)


def _selected(fleet: Fleet) -> list[str]:
    """The compat terms of the router's selectors, as rendered into its command."""
    command = _router_deployment(fleet)["spec"]["template"]["spec"]["containers"][0]["command"]
    return [t for t in command if t.startswith("pdfleet.io/compat=")]


def _settled(fleet: Fleet) -> bool:
    d = _router_deployment(fleet)
    st, want = d.get("status") or {}, d["spec"]["replicas"]
    return (st.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and all(st.get(k, 0) == want for k in ("replicas", "updatedReplicas", "availableReplicas")))


class Keys:
    """The compatibility key of every pod seen: decodes by name, prefills by address (their bootstrap's IP, as an
    answer names it; an IP that served two keys is left out)."""

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}
        self.by_ip: dict[str, set[str]] = {}

    def look(self, fleet: Fleet) -> None:
        for role in ("prefill", "decode"):
            for p in fleet.live_pods(role):
                key = p.metadata.labels.get("pdfleet.io/compat", "")
                self.by_name[p.metadata.name] = key
                if role == "prefill" and p.status.pod_ip:
                    self.by_ip.setdefault(p.status.pod_ip, set()).add(key)

    def crossed(self, traffic: Traffic) -> tuple[int, int]:
        """(answers served by a prefill and a decode of two keys, answers whose pair is known)."""
        crossed = known = 0
        for r in traffic.results:
            ip = (r.answer.prefill or "").rpartition(":")[0]
            decode, prefill = self.by_name.get(r.answer.pod or ""), self.by_ip.get(ip, set())
            if r.ok and decode and len(prefill) == 1:
                known += 1
                crossed += decode not in prefill
        return crossed, known


def _roll(fleet: Fleet, dtype: str, kind: str, watch: list[set[str]], keys: Keys, mixed: list[str]) -> None:
    """Patch the KV dtype and wait until every pod of both roles is of the new revision and the fleet is
    Available, recording the router's selected generations, the pods' keys and any ``Degraded`` message naming
    mixed generations every half second."""
    old = {p.metadata.name for role in ("prefill", "decode") for p in fleet.live_pods(role)}
    fleet.patch(manifest(fleet.ns, router_kind=kind, backend="nixl", model=layout(dtype))["spec"])
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        watch.append(set(_selected(fleet)))
        keys.look(fleet)
        degraded = fleet.conditions().get("Degraded") or {}
        if degraded.get("status") == "True" and "generations mixed" in (degraded.get("message") or ""):
            mixed.append(degraded["message"])
        live = {p.metadata.name for role in ("prefill", "decode") for p in fleet.live_pods(role)}
        if not (old & live) and fleet.available() and _settled(fleet):
            return
        time.sleep(0.5)
    fleet.wait(lambda: False, 1, f"the {dtype} rollout")  # raises with the pods, the status and the logs


def _run(fleet: Fleet, dtype: str, kind: str, mixed: list[str]) -> tuple[Traffic, list[set[str]], tuple[int, int]]:
    keys = Keys()
    keys.look(fleet)
    traffic = fleet.traffic()
    traffic.wait_served(4)
    watch: list[set[str]] = []
    _roll(fleet, dtype, kind, watch, keys, mixed)
    traffic.wait_served(4)
    traffic.stop()
    return traffic, watch, keys.crossed(traffic)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_compatibility_key_rollout_pairs_one_generation_at_a_time_and_without_it_decodes_refuse(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path, kind: str) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods", router_kind=kind, backend="nixl",
                       model=layout("bfloat16")) as fleet:
        before = _selected(fleet)
        assert len(before) == 2 and len(set(before)) == 1, before  # prefill and decode selectors, one key
        mixed: list[str] = []
        traffic, watch, (crossed, known) = _run(fleet, "float16", kind, mixed)
        c = traffic.assert_clean()  # zero client failures, router retries, failed transfers (refusals included)
        refused = sum(traffic.pod_refused.values())
        generations = [w for w in watch if w]
        print(f"{kind}-router, KV dtype bfloat16 -> float16 by generation: {len(traffic.results)} requests, {c}; "
              f"handshake refusals {refused}; answers served across generations {crossed} of {known} whose pair "
              f"is known; router selectors over the rollout: "
              f"{' -> '.join(dict.fromkeys(str(sorted(w)) for w in generations))}")
        assert refused == 0 and crossed == 0 and known >= len(traffic.results) // 2, (refused, crossed, known)
        assert all(len(w) == 1 for w in generations), generations  # one generation at every moment
        assert len(dict.fromkeys(frozenset(w) for w in generations)) == 2, generations  # and it switched once
        assert not mixed, mixed[:2]  # the PDDeployment never said the router pairs two generations

        # The same rollout back, the operator pairing whatever the selectors find.
        operator.restart("--no-router-generations")
        try:
            fleet.wait(lambda: not _selected(fleet) and _settled(fleet), 120, "the router without generations")
            fleet.wait(fleet.router_ready, 120, "the router serving requests")
            traffic, _, (crossed, known) = _run(fleet, "bfloat16", kind, mixed)
            c = traffic.counts()
            refused = sum(traffic.pod_refused.values())
            print(f"{kind}-router, KV dtype float16 -> bfloat16 WITHOUT generations: {len(traffic.results)} "
                  f"requests, {c}; handshake refusals {refused}; answers served across generations {crossed} of "
                  f"{known} whose pair is known")
            # The router paired the two generations: vLLM-contract decodes refuse such pairs at their handshake (as
            # vLLM's does); under the SGLang contract the prefill refuses to plan state of two dtypes ("plan").
            failed = c.client_failures + c.router_retries + c.transfer_failures
            assert crossed == 0 and ((refused > 0) if kind == "vllm" else (failed > 0)), (refused, crossed, c)
            # ... and the PDDeployment said so while it lasted (Degraded, GenerationsMixed, naming the pods)
            print(f"Degraded while the router paired two generations ({len(mixed)} of the half-second looks): "
                  f"{mixed[0][:300] if mixed else None}")
            assert mixed and "decode pods of 2 keys" in "".join(mixed), mixed[:2]
        finally:
            operator.restart()
