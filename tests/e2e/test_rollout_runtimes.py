"""One fleet of real runtime processes (1 prefill, 2 decode, tp 1) on kwok pods, driven by the harness's
kubelet (devcluster.kubelet: each pod in its own network namespace), behind the deployment's router
(sglang-router 0.3.2 from its rendered command), with an ``openai`` client's chat completions flowing
through the router's Service throughout:

- a decode rollout, then scaling out (2 -> 3) and in (3 -> 2): zero client failures, zero router
  retries, zero failed transfers, every answer verified; each old or removed pod had requests in flight
  when its drain started, and left the router (``/health`` 503) before it refused work;
- a decode pod killed (SIGKILL, no drain): the transfers it held fail on the prefill, each to that pod
  and as ``peer_unreachable``; the router retries those requests (new rooms) on the other decode pod;
  a client request fails only if it was in flight at the kill or sent within the router's bound after
  it, and says why; every later request is served by the other pods.

The prefill is started with a write delay so every transfer takes a while.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from pdfleet_runtime.testing.scrape import scrape
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import manifest, running_fleet
from tests.helpers import IDENTITY

pytestmark = pytest.mark.cluster


def transfers_in_flight(url: str) -> float:
    """The runtime's own count of transfers accepted and not finished (0 when it does not answer)."""
    try:
        m = scrape(url + "/metrics")
    except OSError:
        return 0.0
    return sum(v for k, v in m.items() if k.startswith("pdfleet_transfers_in_flight{"))


def test_decode_rollout_scaling_and_a_killed_pod_through_the_router(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        runner = fleet.runner
        gates = {p.metadata.name: {c.type: (c.status, c.reason) for c in p.status.conditions or ()}
                 for p in fleet.core.list_namespaced_pod(namespace, label_selector="pdfleet.io/role").items}
        assert all(g["pdfleet.io/transfer-path"][0] == "True" for g in gates.values()), gates
        # Each runtime wrote its gate with its own pod's token: the Role's reach, no more.
        pod = next(iter(runner.decode_pods().values()))
        assert "--kubeconfig" not in pod.containers[0].proc.args
        out = pod.exec(sys.executable, "-c", IDENTITY)
        assert json.loads(out.stdout or "{}") == {"get own pod": 200, "list secrets": 403}, out.stderr[-2000:]
        # kubectl get pdd shows the endpoint the client uses.
        table = cluster.kubectl("-n", namespace, "get", "pdd").stdout
        assert f"http://live-router.{namespace}.svc:30000" in table, table

        # -- a decode rollout --------------------------------------------------------------------
        old = set(runner.decode_pods())
        traffic = fleet.traffic()
        traffic.wait_served(4)
        assert {r.pod for r in traffic.results if r.ok} <= old
        fleet.patch(manifest(namespace, "v2")["spec"])
        fleet.wait(lambda: not (old & set(runner.decode_pods())) and fleet.available(), 240, "rollout complete")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 60, "traffic on the new pods")

        removed = fleet.scale_decode_out_and_in(traffic)
        traffic.wait_served(4)
        c = traffic.assert_clean()  # rollout, drains, scaling: nothing failed, nothing retried
        assert len(traffic.results) >= 20, c
        [router] = [p for p in list(runner.pods.values()) if p.name.startswith("live-router-") and p.started]
        ends = Counter()
        for name in old | removed:
            in_flight, finished = fleet.drain_log(name)
            assert in_flight >= 1, f"{name} had no transfer in flight when its drain started"
            assert finished, runner.log_of(name)[-2000:]
            # /health 503 first; admission went on until the router had failed its checks, or the bound.
            log = runner.log_of(name)
            waited = re.search(r"admitting until the routers checking it \(([^)]*)\) have each failed 2 checks, "
                               rf"at most {ROUTER_DROP_BOUND_S:g}s", log)
            assert waited and waited.group(1).split(", ") == [router.ip], (router.ip, log[-2000:])
            ended = re.search(r"admission stopped: .*window ended by (routers|bound)", log)
            assert ended, log[-2000:]
            ends[ended.group(1)] += 1
        print(f"drain windows ended by: {dict(ends)}")
        # The real router's checks end windows (each a failure-threshold of rounds, not the whole bound).
        assert ends["routers"] >= 1, ends
        assert not fleet.forced_deletes()
        by_pod = Counter(r.pod for r in traffic.results if r.ok)
        print(f"answers per decode pod: {dict(by_pod)}")

        # -- a decode pod killed ------------------------------------------------------------------
        victim = sorted(runner.decode_pods())[0]
        pod = runner.decode_pods()[victim]
        # Killed while it holds a transfer (the prefill writes slowly), so the kill has something to break.
        fleet.wait(lambda: transfers_in_flight(pod.url) >= 1, 60, f"a transfer in flight on {victim}")
        kill_at = time.monotonic()
        pod.signal(signal.SIGKILL)
        # Every router drops the pod within the bound; the requests sent after it are served by the others
        # (waited for, not slept: the router retries the ones the kill caught, with backoff).
        traffic.chat.wait_answers(3, lambda a: a.started > kill_at + ROUTER_DROP_BOUND_S, timeout=90)
        answers = traffic.chat.stop()
        traffic.halt()
        failed = [a for a in answers if not a.ok]
        counts = traffic.counts()
        [prefill] = runner.running("prefill")
        legs = re.findall(r"request (room-\d+) -> (\S+)\[[\d, ]+\]: failed \((\w+): ", runner.log_of(prefill))
        print(f"killed {victim}: {len(failed)} client requests failed, the router retried {counts.router_retries} "
              f"times, {len(legs)} transfers failed on {prefill}:")
        for room, to, why in legs:
            print(f"  transfer of {room} -> {to}: {why}")
        for a in failed:
            print(f"  request {a.i}: sent {a.started - kill_at:+.2f}s, ended {a.ended - kill_at:+.2f}s after the kill,"
                  f" status {a.status}: {a.problem}")
        # Before the kill nothing failed (assert_clean): every failed transfer is one the killed pod held,
        # refused as unreachable, and none of those rooms answered (the router retried with new rooms). The
        # rest of the failure count is rooms that expired: sent to the prefill for the killed decode, which
        # died before it claimed them.
        print(f"  rooms expired on the prefill: {counts.rooms_expired}")
        assert legs and {(to, why) for _, to, why in legs} == {(victim, "peer_unreachable")}, legs
        assert len({room for room, _, _ in legs}) == counts.transfer_failures - counts.rooms_expired, (legs, counts)
        answered = {f"room-{a.pdfleet.get('room')}" for a in answers if a.ok}
        assert not answered & {room for room, _, _ in legs}
        assert counts.router_retries >= 1 and counts.router_retries >= len(failed)
        # Exactly the requests the killed pod held, or that reached it before every router dropped it, fail:
        # each was in flight at the kill or sent within the router's bound after it, and ended after it.
        for a in failed:
            assert a.started <= kill_at + ROUTER_DROP_BOUND_S and a.ended >= kill_at, a
            assert a.status != 200 and a.pod is None, a
        late = [a for a in answers if a.started > kill_at + ROUTER_DROP_BOUND_S]
        assert late and all(a.ok and a.pod != victim for a in late), [(a.i, a.problem) for a in late if not a.ok]
        assert counts.client_failures == len(failed)
        assert not [a for a in answers if a.ended < kill_at and not a.ok]  # nothing failed before the kill
