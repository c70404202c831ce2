"""A test's operator dies with the test (issue 26, item 5): ``LocalOperator`` started by a parent
process that is then SIGKILLed (as a killed pytest run is) is gone within seconds. It watches an empty
namespace and publishes its own webhook configuration, deleted afterwards, so the session's operator is
untouched.

A test run sent SIGTERM (issue 38) stops what its fixtures started: a pytest of its own (this suite's
conftest, its own cluster) runs a pod through the harness's kubelet; after SIGTERM, no process of its
cluster's namespaces or its pod's is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from tests.unit.test_die_with_parent import alive

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PARENT = """
import sys, time
from pathlib import Path
from pdfleet_devcluster import local_operator as lo
from pdfleet_devcluster.cluster import LocalCluster
lo.WEBHOOK_CONFIGURATION = sys.argv[3]
op = lo.LocalOperator(LocalCluster(Path(sys.argv[1])), Path(sys.argv[2]))
op.start("--webhook-configuration", sys.argv[3], "--namespace", sys.argv[4])
print(op.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_operator_dies_with_the_process_that_started_it(cluster: LocalCluster, crd: str, namespace: str,
                                                            tmp_path: Path) -> None:
    name = f"orphan-{uuid.uuid4().hex[:6]}.pdfleet.io"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(cluster.state_dir), str(tmp_path), name, namespace],
                              stdout=subprocess.PIPE, cwd=REPO)
    operator = 0
    try:
        assert parent.stdout is not None
        operator = int(parent.stdout.readline() or 0)
        assert operator and alive(operator), "the operator did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while alive(operator) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(operator), f"operator {operator} still runs after the process that started it was killed"
    finally:
        if operator and alive(operator):
            os.kill(operator, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")


NESTED = """
import time
from pdfleet_devcluster.kubelet import wait

def test_holds_a_pod(cluster, namespace, tmp_path):
    k = cluster.kubelet(namespace, tmp_path / "pods")
    k.start()
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "held"},
               "spec": {"containers": [{"name": "main", "image": "host", "command": ["sleep", "3600"]}]}}
        import json
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))
        wait(lambda: any(p.started for p in k.pods.values()), 120, "the pod started")
        print("READY", flush=True)
        time.sleep(600)
    finally:
        k.shutdown(grace_s=2)
"""


def test_a_test_run_sent_sigterm_stops_its_clusters_and_pods(tmp_path: Path) -> None:
    from pdfleet_devcluster import procs

    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "test_nested.py").write_text(NESTED)
    state = tmp_path / "cluster"
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-s", "-q",
                            "--rootdir", str(tmp_path / "nested"), str(tmp_path / "nested" / "test_nested.py")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PDFLEET_TEST_CLUSTER_DIR": str(state)})
    assert run.stdout is not None
    seen: list[procs.Proc] = []
    try:
        lines = []
        for line in run.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines)[-3000:]
        apiserver = int(json.loads((state / "pids.json").read_text())["kube-apiserver"])

        def held() -> bool:
            """The pod's process has become ``sleep`` (a started container may not have exec'd yet: until then
            it carries its parent's command line) and the apiserver is among the namespaces' processes."""
            nonlocal seen
            inodes = {procs.net_ns(apiserver), *procs.pod_namespaces(apiserver).values()}
            seen = procs.in_namespaces({i for i in inodes if i is not None})
            return any(p.cmd.startswith("sleep 3600") for p in seen) and any("kube-apiserver" in p.cmd for p in seen)

        deadline = time.monotonic() + 60
        while not held():
            assert time.monotonic() < deadline, [str(p) for p in seen]
            time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
        left = [str(p) for p in seen if p.alive()]
        assert left == [], f"left running after SIGTERM: {left}\n{out[-3000:]}"
    finally:
        if run.poll() is None:
            run.kill()
        for p in seen:
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)
