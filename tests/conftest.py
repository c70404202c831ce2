"""Shared fixtures: one real local control plane per test session.

Cluster tests (``-m cluster``) share a single LocalCluster started on first
use and stopped at the end of the session; each test gets its own namespace.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import ClusterOptions, LocalCluster, ensure_toolchain, sandbox
from pdfleet_devcluster.local_operator import LocalOperator
from tests.helpers import wait_until


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = Path(os.environ.get("PDFLEET_TEST_CLUSTER_DIR", tmp_path_factory.mktemp("cluster")))
    opts = ClusterOptions(nodes=3, gpus_per_node=8, sandbox_index=worker_index(request.config))
    lc = LocalCluster(state, opts, die_with_parent=True)
    lc.start()
    try:
        yield lc
    finally:
        lc.stop()


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # The ServiceAccount admission plugin rejects pods until the controller made `default`.
    wait_until(
        lambda: cluster.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        what=f"default ServiceAccount in {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# -- the CRD and the operator as a subprocess (cluster and e2e tests) ---------------------------
# ``operator`` runs ``python -m pdfleet_operator --dev-webhook 127.0.0.1:PORT`` against the test
# cluster (kopf manages its own ValidatingWebhookConfiguration there) and stops it with SIGINT at
# teardown; tests can restart it with other flags (``restart(*args)``).


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> str:
    """The generated CRD, applied and served (discovery included)."""
    return cluster.install_crd()


@pytest.fixture(scope="module")
def operator(
    cluster: LocalCluster, crd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalOperator]:
    op = LocalOperator(cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="module")
def kueue(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Kueue's manager beside the cluster (``pdfleet_devcluster.kueue_run``) for a module's tests; opt-in, as its
    build takes minutes cold: skipped unless Kueue was built already or ``PDFLEET_BUILD_KUEUE=1``."""
    from pdfleet_devcluster.kueue import kueue_dir
    from pdfleet_devcluster.kueue_run import release_pods, start_kueue
    from pdfleet_operator.cachedbuild import is_complete

    if not is_complete(kueue_dir()) and os.environ.get("PDFLEET_BUILD_KUEUE") != "1":
        pytest.skip("Kueue is built on demand: PDFLEET_BUILD_KUEUE=1 (or python -m pdfleet_devcluster.kueue)")
    proc = start_kueue(cluster, Path(tmp_path_factory.mktemp("kueue")))
    try:
        yield proc
    finally:
        release_pods(cluster)  # the module's pods must not outlive Kueue with its finalizer (GPUs held)
        proc.stop()


# -- the private network namespace of each test process -------------------------------------------
# Every test runs inside a network and mount namespace of its worker's own (devcluster.sandbox):
# loopback and the cluster bridge only, so nothing a test starts reaches any other address. The
# toolchain is built before (the builds need the module proxy); under xdist the controller builds
# it once and each worker enters its own namespace, with its own pod and Service ranges.


def worker_index(config: pytest.Config) -> int:
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workerid"].removeprefix("gw")) if workerinput else 0


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a CI timeout, `kill`) as Ctrl-C: pytest then runs every fixture's teardown, so the clusters,
    # kubelets, pods and operators the run started are stopped, not left running (issue 38).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if not hasattr(config, "workerinput"):
        ensure_toolchain()
    if not controller:
        sandbox.enter(sandbox.Ranges(worker_index(config)))


# -- the end-to-end tests' traffic counts in the run's summary ---------------------------------------
# Each e2e test prints its client failures, router retries and failed transfers (tests/e2e/traffic.py);
# under xdist a passing test's output is not shown, so the summary repeats those lines for every test.
TRAFFIC_LINES = ("traffic through the router:", "killed ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [f"{rep.nodeid.rsplit('::', 1)[-1]}: {line}"
             for key in ("passed", "failed") for rep in terminalreporter.stats.get(key, [])
             if getattr(rep, "when", "") == "call"
             for line in rep.capstdout.splitlines() if line.startswith(TRAFFIC_LINES)]
    if lines:
        terminalreporter.write_sep("-", "client traffic through the router (counts)")
        for line in lines:
            terminalreporter.write_line(line)


# -- where the suite's time goes: PDFLEET_TEST_TIMELINE=FILE writes every phase of every test as JSON ---------
# (node id, phase, seconds, worker, when it ended), so a slow CI run can be read for its longest files and for a
# worker left idle at the end (the 45-minute budget, issue 38). Written by the controller only; the variable is
# taken out of the environment so a pytest the suite starts itself (test_orphans) cannot overwrite the file.
_TIMELINE: list[dict] = []
_TIMELINE_PATH = os.environ.pop("PDFLEET_TEST_TIMELINE", "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _TIMELINE_PATH:
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", "main")
        _TIMELINE.append({"test": report.nodeid, "phase": report.when, "seconds": round(report.duration, 3),
                          "worker": worker, "ended": time.time(), "outcome": report.outcome})


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = _TIMELINE_PATH
    if path and not hasattr(session.config, "workerinput"):
        Path(path).write_text(json.dumps(_TIMELINE))
