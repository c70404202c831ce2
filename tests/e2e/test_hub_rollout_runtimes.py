"""A Hub model's new commit is a rollout of both roles that never pairs the two commits (issue 47).

A stand-in of the Hub (``tests/hub_standin.py``, on the node's address of the run's own pod bridge: no network)
serves two commits of the project's Zen model: A, and B with every weight perturbed, so the two answer
differently. A fleet of built-in runtime pods (the reference engine) loads ``huggingFace.revision`` A through
the node's weights cache (``huggingFace.cache``: a hostPath the harness's kubelet binds), behind its
sglang-router, with chats flowing throughout. Checked:

- the first prefill and decode, started together on the one node, download A's files once between them;
- the revision changed to B rolls both roles as one generation with zero client failures, zero router
  retries and zero failed transfers (a decode of one commit refusing a prefill of the other would count
  there); every answer equals aggregate generation of the commit its decode pod was rendered for (A before,
  B after), computed by the test with transformers from each commit's files; B is downloaded once;
- during the rollout, B's first prefill pod, killed once it holds its weights and before it is Ready (its pod
  deleted with no grace, as a node would lose it), comes back on B from the node's cache: its log says so,
  nothing more is downloaded, and the rollout goes on with the counts above still zero.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.commands.demo_model import model_spec
from tests.cluster.conftest import OperatorProcess
from tests.e2e.model_traffic import DIFFERS, ModelCheck
from tests.e2e.traffic import NAME, running_fleet
from tests.hub_standin import MODEL as HUB_MODEL
from tests.hub_standin import A, B, running_hub
from tests.server.test_hub_model_serve import CACHED, DOWNLOADED
from tests.zen import zen_model_dir

pytestmark = pytest.mark.cluster


def perturbed_copy(src: Path, dst: Path) -> Path:
    """``src`` with every floating weight moved by a fixed amount of seeded noise: the same config and layout,
    other answers (commit B)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(47)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for k, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
                tensors[k] = (t + 0.5 * t.float().std().to(t.dtype) * noise).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())


def _wall(t: float) -> str:
    """A ``time.monotonic()`` instant as the wall-clock time the pods' logs stamp."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - t)))


class TwoCommits(ModelCheck):
    """An answer is right when it equals aggregate generation of A or of B; ``commit_of`` says which."""

    def __init__(self, a: ModelCheck, b: ModelCheck) -> None:  # the two checks' aggregates, none of its own
        self.a, self.b = a, b
        self.served_name, self.max_tokens, self.prompts = a.served_name, a.max_tokens, a.prompts

    def verify(self, body: dict[str, Any], answer: dict[str, Any]) -> str | None:
        problem = self.a.verify(body, answer)
        return None if problem is None or self.b.verify(body, answer) is None else problem

    def commit_of(self, body: dict[str, Any], answer: dict[str, Any]) -> set[str]:
        return {c for c, check in (("A", self.a), ("B", self.b)) if check.verify(body, answer) is None}


def test_a_new_hub_commit_rolls_both_roles_without_pairing_two_commits(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    zen = zen_model_dir()
    zen_b = perturbed_copy(zen, tmp_path / "zen-b")
    a, b = ModelCheck(zen, NAME), ModelCheck(zen_b, NAME)
    differing = [p for p in a.prompts if a.expected[p][1] != b.expected[p][1]]
    assert len(differing) >= len(a.prompts) // 2, "commit B must answer differently to tell the commits apart"
    check = TwoCommits(a, b)
    files = {c: {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}
             for c, d in ((A, zen), (B, zen_b))}
    cache = tmp_path / "node-weights"
    with running_hub(host=cluster.options.ranges.gateway) as hub:
        hub.files = files

        layout = model_spec(zen)["layout"]

        def model(commit: str) -> dict[str, Any]:
            return {"layout": layout, "source": {"huggingFace": {
                "id": HUB_MODEL, "revision": commit, "endpoint": hub.endpoint,
                "cache": {"hostPath": {"path": str(cache), "type": "DirectoryOrCreate"}}}}}

        def downloads(commit: str) -> list[str]:
            return sorted(name for sha, name in list(hub.downloads) if sha == commit)

        with running_fleet(cluster, namespace, tmp_path / "pods", check=check, model=model(A),
                           decode=1) as fleet:
            runner = fleet.runner
            logs = [p.log() for r in ("prefill", "decode") for p in runner.running(r).values()]
            assert sorted(DOWNLOADED in log for log in logs) == [False, True], [log[-1500:] for log in logs]
            assert sorted(CACHED in log for log in logs) == [False, True]
            assert downloads(A) == sorted(files[A]) and downloads(B) == []  # once for the node's two pods
            rev_a = {"prefill": fleet.revisions("prefill"), "decode": fleet.revisions("decode")}

            traffic = fleet.traffic()
            traffic.wait_served(6, timeout=180)
            fleet.patch({"model": model(B)})

            # -- during the rollout, B's first prefill killed once it holds its weights, before it serves ----
            def weighted_b_prefill() -> Any:
                """A live prefill pod of the new revision whose runtime has its weights (downloaded or from the
                cache) and that is not yet Ready, so no router sends it a request; None before."""
                sandboxes = runner.running("prefill")
                for p in fleet.live_pods("prefill"):
                    sandbox = sandboxes.get(p.metadata.name)
                    if (p.metadata.labels["pdfleet.io/revision"] not in rev_a["prefill"] and not _ready(p)
                            and sandbox is not None and sandbox.uid == p.metadata.uid
                            and (DOWNLOADED in (log := sandbox.log()) or CACHED in log)):
                        return p
                return None

            victim = fleet.wait(weighted_b_prefill, 300, "commit B's prefill holding its weights, not yet Ready")
            fleet.wait(lambda: downloads(B) == sorted(files[B]), 60, "commit B's files all downloaded")
            seen = len(hub.downloads)
            fleet.core.delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
            print(f"killed {victim.metadata.name} at {_wall(time.monotonic())}", flush=True)

            def recreated() -> Any:
                """The pod in the victim's place, once its sandbox runs with its weights; None before."""
                sandboxes = runner.running("prefill")
                for p in fleet.live_pods("prefill"):
                    sandbox = sandboxes.get(p.metadata.name)
                    if (p.metadata.uid != victim.metadata.uid and p.metadata.labels["pdfleet.io/revision"]
                            not in rev_a["prefill"] and sandbox is not None and sandbox.uid == p.metadata.uid
                            and (DOWNLOADED in (log := sandbox.log()) or CACHED in log)):
                        return log
                return None

            back_log = fleet.wait(recreated, 240, "B's prefill back, with its weights")
            assert CACHED in back_log and DOWNLOADED not in back_log, back_log[-2000:]
            assert B[:12] in back_log and len(hub.downloads) == seen

            fleet.wait(lambda: all(set(fleet.revisions(r)).isdisjoint(rev_a[r]) for r in rev_a) and fleet.available(),
                       300, "both roles rolled to commit B")
            rev_b = fleet.revisions("decode")
            fleet.wait(lambda: sum(r.ok and r.revision in rev_b for r in traffic.results) >= 10, 180,
                       "answers from commit B's pods")
            results = traffic.stop()
            for f in traffic.chat.failures():  # when, against the pods' and routers' event logs, should any fail
                print(f"failed request {f.i}: {_wall(f.started)} -> {_wall(f.ended)}, status {f.status}: {f.problem}")
            counts = traffic.assert_clean()  # no client failure, router retry or failed (refused) transfer
            assert counts.differ == 0, counts
            assert downloads(B) == sorted(files[B]) and downloads(A) == sorted(files[A])
            assert len(hub.downloads) == seen, "nothing downloaded after the kill"

    # Every answer is the one its decode pod's commit gives: A's pods A's, B's pods B's, never another.
    served = {"A": 0, "B": 0}
    for r in results:
        assert r.answer.ok or not (r.answer.problem or "").startswith(DIFFERS), r.answer.problem
        if not r.ok:
            continue
        commits = check.commit_of(check.body(r.answer.i), r.answer.body)
        want = "A" if r.revision in rev_a["decode"] else "B"
        assert want in commits, (r.revision, commits, r.answer.body)
        served[want] += 1
    assert served["A"] >= 6 and served["B"] >= 10, served
    print(f"hub commits A -> B: {served} answers checked per commit, {len(differing)}/{len(a.prompts)} prompts "
          f"answer differently; downloads {len(files[A])}+{len(files[B])} files, none after B's prefill was "
          f"killed mid-rollout; the rollout's traffic: {counts}", flush=True)
