"""What the chart installs cluster-wide besides the CRD, for the local cluster: the runtime pod-status
ValidatingAdmissionPolicy (``resources.pod_status_policy``), bound in every namespace."""

from __future__ import annotations

import yaml

from pdfleet_operator.resources.pod_status_policy import policy, policy_binding

__all__ = ["runtime_policy_yaml"]


def runtime_policy_yaml() -> str:
    """The policy and its binding, as one YAML stream for ``kubectl apply --server-side``."""
    return yaml.safe_dump_all([policy(), policy_binding()])
