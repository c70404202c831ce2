"""Cluster fixtures beyond the control plane: the CRD installed, and the operator as a subprocess.

``operator`` runs ``python -m pdfleet_operator --dev-webhook 127.0.0.1:PORT`` against the test
cluster (kopf manages its own ValidatingWebhookConfiguration there) and stops it with SIGINT at
teardown, so kopf removes its webhook from the configuration on the way out. Tests can restart it
with other flags (``restart(*args)``), e.g. the re-check's ``--test-deny-cell`` hook.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdfleet_operator.api.crd import CRD_FILE, CRD_NAME
from pdfleet_operator.devcluster import LocalCluster
from pdfleet_operator.devcluster.local_operator import LocalOperator
from tests.helpers import wait_until

OperatorProcess = LocalOperator  # the name the cluster tests use


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> str:
    """The generated CRD, applied and served (discovery included)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=70)
    wait_until(lambda: cluster.kubectl("get", "pdd", "-A", check=False).returncode == 0, what="pdd discovery")
    return CRD_NAME


@pytest.fixture(scope="module")
def operator(
    cluster: LocalCluster, crd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
