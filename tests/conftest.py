"""Shared fixtures: one real local control plane per test session.

Cluster tests (``-m cluster``) share a single LocalCluster started on first
use and stopped at the end of the session; each test gets its own namespace.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_operator.devcluster import ClusterOptions, LocalCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = Path(os.environ.get("PDFLEET_TEST_CLUSTER_DIR", tmp_path_factory.mktemp("cluster")))
    lc = LocalCluster(state, ClusterOptions(nodes=3, gpus_per_node=8), die_with_parent=True)
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
    from tests.helpers import wait_until

    wait_until(
        lambda: cluster.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        what=f"default ServiceAccount in {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
