"""vllm-router in front of built-in runtime pods in the local cluster (issue 44): the router pod runs vllm-router
0.1.17 with its rendered arguments verbatim (Kubernetes discovery of the roles' pods, the worker key in
``OPENAI_API_KEY`` from the worker-key Secret) behind pdfleet's front; the runtime pods speak vLLM's PD contract
(``pod/vllm_contract.py``): NIXL's two steps, the prefill's answer handing the decode its room, bootstrap and
engine id. Chat completions flow through the router's Service throughout, each answer's state verified byte for
byte by the decode:

- a decode rollout, then scaling 2 -> 3 -> 2: zero client failures, zero router retries, zero failed transfers;
- the prefill pod lost (its processes killed, the pod deleted, as when its node fails) and replaced by the
  operator: a new pod, a new engine id; the client requests that failed in between are counted and printed,
  and the new prefill serves through the router within ``REPLACED_WITHIN_S`` of the loss;
- a decode pod killed (SIGKILL, no drain) under fresh traffic: a client request fails only if it was in flight
  at the kill or sent within the router's drop bound (its health checks, rendered as for sglang-router) after
  it; every later request is served by the other decode, its state verified. The failures, the router's
  retries and the pods' failed transfers are counted and printed.

Mooncake is not run here: admission denies vllm-router's discovery with Mooncake (``vllm-router-mooncake-
discovery``: 0.1.17 never asks a discovered prefill's bootstrap for its engine id, so decodes get no
``kv_transfer_params``; seen in this test's first run, "No Mooncake bootstrap info for prefill"). Its static
form, and a prefill restarted in place, are in tests/vllm/test_vllm_router_pd.py.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import NAME, manifest, running_fleet

pytestmark = pytest.mark.cluster

REPLACED_WITHIN_S = 180.0
"""From the loss to the first answer through the new prefill: the operator replaces the pod, its canary
passes, vllm-router's discovery adds it (24 and 45 s measured on this 2-core host)."""
PROBE_S = 0.5


def test_a_nixl_fleet_behind_vllm_router_rolls_clean_and_serves_again_after_its_prefill_is_lost(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    backend = "nixl"
    with running_fleet(cluster, namespace, tmp_path / "pods", router_kind="vllm", backend=backend) as fleet:
        runner = fleet.runner
        [router] = [p for p in fleet.core.list_namespaced_pod(namespace).items
                    if p.metadata.name.startswith(f"{NAME}-router-")]
        command = router.spec.containers[0].command
        assert command[:2] == ["vllm-router", "--vllm-pd-disaggregation"], command
        assert f"--kv-connector {backend}" in " ".join(command), command
        env = {e.name: e.value_from.secret_key_ref.name for e in router.spec.containers[0].env or ()}
        assert env == {"OPENAI_API_KEY": f"{NAME}-worker-auth"}, env

        # -- a decode rollout --------------------------------------------------------------------
        old = set(runner.decode_pods())
        traffic = fleet.traffic()
        traffic.wait_served(4)
        fleet.patch(manifest(namespace, "v2", router_kind="vllm", backend=backend)["spec"])
        fleet.wait(lambda: not (old & set(runner.decode_pods())) and fleet.available(), 240, "rollout complete")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 60, "traffic on the new pods")

        fleet.scale_decode_out_and_in(traffic)
        traffic.wait_served(4)
        clean = traffic.assert_clean()  # zero client failures, router retries and failed transfers
        print(f"vllm-router ({backend}) decode rollout, scale 2 -> 3 -> 2: {len(traffic.results)} requests, {clean}")

        # -- the prefill lost, replaced --------------------------------------------------------------
        [(victim, pod)] = list(runner.running("prefill").items())
        kill_at = time.monotonic()
        pod.signal(signal.SIGKILL)  # the node is gone: its processes, then the pod object
        cluster.kubectl("-n", namespace, "delete", "pod", victim, "--grace-period=0", "--force", "--wait=false")
        in_flight = [a for a in traffic.chat.stop() if a.ended > kill_at]  # those the loss caught
        traffic.halt()
        # One client, one request every PROBE_S, until three in a row came through the new prefill.
        probe, probes, served = fleet.chat_traffic(), [], 0
        while served < 3 and time.monotonic() - kill_at < REPLACED_WITHIN_S:
            answer = probe.once(len(probes))
            probes.append(answer)
            served = served + 1 if answer.ok else 0
            time.sleep(PROBE_S)
        assert served == 3, [(round(a.started - kill_at, 1), a.problem) for a in probes[-5:]]
        # By its sandbox, not its name: the operator may recreate the pod under the name the loss freed.
        [replacement] = [p for p in runner.running("prefill").values() if p is not pod]
        new, new_ip = replacement.name, replacement.ip
        after = [a for a in probes if a.ok]
        first = min(a.ended for a in after) - kill_at
        failed = [a for a in in_flight + probes if not a.ok]
        counts = traffic.counts()
        print(f"prefill {victim} lost, replaced by {new}: first answer through it {first:.1f}s after the loss; "
              f"{len(failed)} client requests failed ({len(in_flight)} in flight at the loss, {len(probes)} probes "
              f"every {PROBE_S:g}s after it), router retries {counts.router_retries}:")
        kinds = Counter((a.status, (a.problem or "")[:80]) for a in failed)
        for (status, problem), n in kinds.most_common(6):
            print(f"  {n} x {status}: {problem}")
        assert first <= REPLACED_WITHIN_S, first
        assert all(a.started <= kill_at + first for a in failed), \
            [(a.started - kill_at, a.problem) for a in failed]  # nothing failed once the new prefill served
        # Every answer after the loss came through the new prefill, its state verified.
        assert all(a.pdfleet.get("verified") and (a.prefill or "").startswith(f"{new_ip}:") for a in after), after[:3]

        # -- a decode killed (SIGKILL, no drain) -------------------------------------------------------
        # The router had no worker while the prefill was gone, so its pod went unready: fresh connections are
        # refused until it is Ready again (the probes above came through a kept-alive connection).
        fleet.wait(fleet.routers_ready, 60, "the router pod Ready, a fresh connection served")
        traffic = fleet.traffic()
        traffic.wait_served(4)
        victim = sorted(runner.decode_pods())[0]
        kill_at = time.monotonic()
        runner.decode_pods()[victim].signal(signal.SIGKILL)
        # Waited for, not slept: three requests sent after every router check dropped the pod came back.
        traffic.chat.wait_answers(3, lambda a: a.started > kill_at + ROUTER_DROP_BOUND_S, timeout=90)
        answers = traffic.chat.stop()
        traffic.halt()
        failed = [a for a in answers if not a.ok]
        counts = traffic.counts()
        print(f"decode {victim} killed: {len(answers)} requests, {len(failed)} failed, router retries "
              f"{counts.router_retries}, transfer failures {counts.transfer_failures} {counts.per_pod}")
        for a in failed:
            print(f"  request {a.i}: sent {a.started - kill_at:+.2f}s, ended {a.ended - kill_at:+.2f}s after the kill,"
                  f" status {a.status}: {(a.problem or '')[:120]}")
        assert not [a for a in answers if a.ended < kill_at and not a.ok]  # nothing failed before the kill
        for a in failed:  # only what the kill caught, or what reached the pod before the routers dropped it
            assert a.started <= kill_at + ROUTER_DROP_BOUND_S and a.ended >= kill_at, a
        late = [a for a in answers if a.started > kill_at + ROUTER_DROP_BOUND_S]
        assert late and all(a.ok and a.pod != victim and a.pdfleet.get("verified") for a in late), \
            [(a.i, a.pod, a.problem) for a in late if not (a.ok and a.pod != victim)]
