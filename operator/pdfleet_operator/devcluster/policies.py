"""What the chart installs cluster-wide besides the CRD, for the local cluster: the runtime pod-status
ValidatingAdmissionPolicy (``resources.pod_status_policy``) and the pod-labels one
(``resources.pod_label_policy``), bound in every namespace."""

from __future__ import annotations

from typing import TYPE_CHECKING

import yaml

from pdfleet_operator.resources import pod_label_policy, pod_status_policy

if TYPE_CHECKING:
    from pdfleet_operator.devcluster.cluster import LocalCluster

__all__ = ["install_runtime_policy"]


def install_runtime_policy(cluster: LocalCluster) -> None:
    """Apply the policy and its binding (idempotent, server-side)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all([pod_status_policy.policy(), pod_status_policy.policy_binding(),
                                              pod_label_policy.policy(), pod_label_policy.policy_binding()]))
