"""A fleet that answers with a real model's text: runtime pods computing the project's Zen model (a hybrid
Qwen3-Next: Gated DeltaNet recurrent and conv state beside the KV cache), prefill TP 2 -> decode TP 1 over
Mooncake, behind the deployment's sglang-router, the model reaching the pods as a hostPath volume (the harness's
kubelet), with its layout from the model's config and its digest pinned (``demo_model.model_spec``).

Real prompts flow through the router's Service throughout (the 17 questions the model learnt and chats it did
not); every answer is checked against aggregate generation the test computes itself with transformers from the
same directory (``model_traffic.ModelCheck``). A decode rollout and scaling the decodes 2 -> 3 -> 2 keep every
count at zero: client failures, router retries, transfer failures, answers that differ from aggregate. Then a
decode pod is killed (SIGKILL, no drain): only requests in flight at the kill, or sent within the router's bound
after it, may fail, each as an error, never as text; no answer differs from aggregate, and the requests sent
after the bound are answered by the other pod.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.commands.demo_model import model_spec
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from tests.cluster.conftest import OperatorProcess
from tests.e2e.model_traffic import ModelCheck
from tests.e2e.traffic import NAME, Result, running_fleet
from tests.zen import zen_model_dir

pytestmark = pytest.mark.cluster


def test_a_zen_model_fleet_tp2_to_1_answers_as_aggregate_through_a_rollout_and_scaling(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    zen = zen_model_dir()
    check = ModelCheck(zen, NAME)
    with running_fleet(cluster, namespace, tmp_path / "pods", check=check, model=model_spec(zen),
                       prefill_tp=2) as fleet:
        runner = fleet.runner
        traffic = fleet.traffic()
        traffic.wait_served(len(check.prompts), timeout=240)  # every prompt at least once on average

        old = set(runner.decode_pods())
        fleet.patch({"decode": {"env": [{"name": "ROLLOUT_MARK", "value": "v2"}]}})
        fleet.wait(lambda: not (old & set(runner.decode_pods())) and fleet.available(), 300, "rollout complete")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 120,
                   "answers from the new decode pods")

        fleet.scale_decode_out_and_in(traffic, timeout=180, answer_timeout=120)
        traffic.wait_served(4, timeout=120)
        clean = traffic.assert_clean()  # up to here nothing failed and nothing differed
        assert clean.checked is not None and clean.checked >= len(check.prompts) and clean.differ == 0, clean

        # -- a decode pod killed ------------------------------------------------------------------
        victim = sorted(runner.decode_pods())[0]
        kill_at = time.monotonic()
        runner.decode_pods()[victim].signal(signal.SIGKILL)
        traffic.chat.wait_answers(3, lambda a: a.started > kill_at + ROUTER_DROP_BOUND_S, timeout=120)
        results = traffic.stop()
        counts = traffic.counts()
        assert counts.checked is not None and counts.checked == sum(r.ok for r in results) + counts.differ, counts
        assert counts.differ == 0, [r.answer.problem for r in results if not r.ok][:3]
        failed = [r.answer for r in results if not r.ok]
        for a in failed:  # in flight at the kill or sent within the bound after it; an error, never text
            assert a.started <= kill_at + ROUTER_DROP_BOUND_S and a.ended >= kill_at, a
            assert a.status != 200 and a.pod is None, a
        late = [r for r in results if r.answer.started > kill_at + ROUTER_DROP_BOUND_S]
        assert late and all(r.ok and r.pod != victim for r in late), [r.answer.problem for r in late if not r.ok]
        print(f"killed {victim}: {len(failed)} client requests failed, {len(late)} answered after the router's "
              f"bound, router retries {counts.router_retries}", flush=True)
        # Every prompt was answered, and the question the demo asks as the model was trained to answer it.
        def prompt(r: Result) -> str:
            return check.prompts[r.answer.i % len(check.prompts)]  # ChatTraffic's request i sent check.body(i)

        assert {prompt(r) for r in results if r.ok} == set(check.prompts)
        line3 = [r for r in results if prompt(r) == "Recite the Zen of Python from line 3."]
        assert line3 and all(r.answer.body["choices"][0]["message"]["content"] == "Simple is better than complex. "
                             "Complex is better than complicated. Flat is better than nested." for r in line3)
        print(f"zen model fleet, prefill tp 2 -> decode tp 1: {counts}", flush=True)
