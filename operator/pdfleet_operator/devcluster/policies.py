"""What the chart installs cluster-wide besides the CRD, for the local cluster: the runtime pod-status
ValidatingAdmissionPolicy (``resources.pod_status_policy``), bound in every namespace."""

from __future__ import annotations

from typing import TYPE_CHECKING

import yaml

from pdfleet_operator.resources.pod_status_policy import policy, policy_binding

if TYPE_CHECKING:
    from pdfleet_operator.devcluster.cluster import LocalCluster

__all__ = ["install_runtime_policy"]


def install_runtime_policy(cluster: LocalCluster) -> None:
    """Apply the policy and its binding (idempotent, server-side)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all([policy(), policy_binding()]))
