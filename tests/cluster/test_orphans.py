"""A test's operator dies with the test (issue 26, item 5): ``LocalOperator`` started by a parent
process that is then SIGKILLed (as a killed pytest run is) is gone within seconds. It watches an empty
namespace and publishes its own webhook configuration, deleted afterwards, so the session's operator is
untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdfleet_operator.devcluster import LocalCluster
from tests.unit.test_die_with_parent import alive

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PARENT = """
import sys, time
from pathlib import Path
from pdfleet_operator.devcluster import local_operator as lo
from pdfleet_operator.devcluster.cluster import LocalCluster
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
