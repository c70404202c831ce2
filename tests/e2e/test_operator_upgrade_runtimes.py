"""An operator upgrade with a fleet serving through its router (issue 47): the revision covers what the
operator renders, so an upgrade that renders a pod differently rolls every role once, as a spec change
would (surge, drains, canary), and one that renders the same pods rolls nothing.

The upgrade is a second operator process running a copy of this checkout's ``pdfleet_operator`` put first
on its ``PYTHONPATH``, with one change: the rendered ``/tmp`` volume's size (a rendering change), or a
comment (none). The runtime pods run this checkout's runtime throughout. Before each upgrade, the new
release's ``pdfleet render --diff`` says what it will change: both roles and the field, then nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.local_operator import LocalOperator
from tests.e2e.traffic import NAME, Fleet, running_fleet

pytestmark = pytest.mark.cluster

OPERATOR_PKG = Path(__file__).resolve().parents[2] / "operator" / "pdfleet_operator"
PODS = Path("resources") / "pods.py"
OLD_TMP, NEW_TMP = 'TMP_SIZE_LIMIT = "1Gi"', 'TMP_SIZE_LIMIT = "2Gi"'


def _upgraded(where: Path, old: str, new: str) -> dict[str, str]:
    """A copy of the operator's package with ``old`` replaced by ``new`` in resources/pods.py; the env that
    runs it."""
    pkg = where / "pdfleet_operator"
    shutil.copytree(OPERATOR_PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    text = (pkg / PODS).read_text()
    assert text.count(old) == 1, f"{old!r} is not in {PODS} once: update this test with the rendering"
    (pkg / PODS).write_text(text.replace(old, new))
    return {"PYTHONPATH": str(where)}


@pytest.fixture
def operators(cluster: LocalCluster, crd: str, tmp_path: Path) -> Iterator[list[LocalOperator]]:
    """Started by the test, one after the other (the upgrade); every one stopped at the end."""
    started: list[LocalOperator] = []
    yield started
    for op in started:
        op.stop()


def _upgrade(operators: list[LocalOperator], cluster: LocalCluster, where: Path, env: dict[str, str]) -> None:
    operators[-1].stop()
    op = LocalOperator(cluster, where / "state", extra_env=env)
    operators.append(op)
    op.start()


def _render_diff(cluster: LocalCluster, ns: str, env: dict[str, str]) -> tuple[int, str]:
    """``pdfleet render --diff`` of the fleet, run by the release whose code ``env`` puts first."""
    proc = subprocess.run([sys.executable, "-m", "pdfleet_operator.cli", "render", "--diff", NAME, "-n", ns],
                          env={**os.environ, **env, "KUBECONFIG": str(cluster.kubeconfig)}, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def _tmp_limits(fleet: Fleet) -> set[str]:
    return {v.empty_dir.size_limit for p in fleet.core.list_namespaced_pod(fleet.ns).items
            if p.metadata.labels.get("pdfleet.io/role") and p.metadata.deletion_timestamp is None
            for v in p.spec.volumes if v.name == "tmp"}


def test_an_upgrade_rolls_once_when_the_rendering_changes_and_never_when_it_does_not(
        cluster: LocalCluster, operators: list[LocalOperator], namespace: str, tmp_path: Path) -> None:
    first = LocalOperator(cluster, tmp_path / "v1")
    operators.append(first)
    first.start()
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        old = {role: set(fleet.revisions(role)) for role in ("prefill", "decode")}
        assert all(len(r) == 1 for r in old.values()), old
        assert _tmp_limits(fleet) == {"1Gi"}
        timeline = fleet.timeline(synced=3)
        traffic = fleet.traffic()
        traffic.wait_served(4)

        assert _render_diff(cluster, namespace, {})[0] == 0  # the running release: nothing to change
        v2 = _upgraded(tmp_path / "v2", OLD_TMP, NEW_TMP)
        rc, said = _render_diff(cluster, namespace, v2)
        assert rc == 1 and said.count("its operator rolls") == 2, said
        assert 'pod.spec.volumes[tmp].emptyDir.sizeLimit: "1Gi" -> "2Gi"' in said, said
        _upgrade(operators, cluster, tmp_path / "v2", v2)
        new = {}
        for role in ("prefill", "decode"):
            new[role] = fleet.wait(lambda r=role: (t := (fleet.status()["rollout"][r]).get("targetRevision"))
                                   not in old[r] and t, 60, f"the upgraded operator's {role} revision")
        replicas = {"prefill": 1, "decode": 2}
        for role, n in replicas.items():
            fleet.wait(lambda r=role, k=n: fleet.settled_on(new[r], k, r), 300, f"{role} rolled to the new rendering")
        assert _tmp_limits(fleet) == {"2Gi"}
        traffic.wait_served(6)
        settled = {role: set(timeline.ever(role)) for role in replicas}

        # An upgrade that renders the same pods (a comment changed): no revision moves, no pod is made.
        v3 = _upgraded(tmp_path / "v3", OLD_TMP, f"{NEW_TMP}  # v3")
        rc, said = _render_diff(cluster, namespace, v3)
        assert rc == 0 and said.count(": unchanged") == 2, said
        _upgrade(operators, cluster, tmp_path / "v3", v3)
        time.sleep(20)  # a few reconcile passes of the new operator
        for role in replicas:
            st = fleet.status()["rollout"][role]
            assert st.get("targetRevision") == st.get("stableRevision") == new[role], st
        traffic.wait_served(3)
        results = traffic.stop()
        timeline.stop()

        counts = traffic.assert_clean()
        print(f"operator upgrade: {len(results)} requests, {counts}")
        for role, n in replicas.items():
            ever = timeline.ever(role)
            assert {s.revision for s in ever.values()} == old[role] | {new[role]}, ever  # one roll, one target
            assert sum(s.revision == new[role] for s in ever.values()) == n, ever  # each new pod made once
            assert set(ever) == settled[role], "the no-op upgrade made or removed pods"
        assert not fleet.forced_deletes()
