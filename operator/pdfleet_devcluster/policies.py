"""What the chart installs cluster-wide besides the CRD, for the local cluster: the runtime pod-status
ValidatingAdmissionPolicy (``resources.pod_status_policy``) and the pod-labels one
(``resources.pod_label_policy``), bound in every namespace."""

from __future__ import annotations

import yaml

from pdfleet_operator.resources import pod_label_policy, pod_status_policy

__all__ = ["runtime_policy_yaml"]


def runtime_policy_yaml() -> str:
    """The policies and their bindings, as one YAML stream for ``kubectl apply --server-side``."""
    return yaml.safe_dump_all([pod_status_policy.policy(), pod_status_policy.policy_binding(),
                               pod_label_policy.policy(), pod_label_policy.policy_binding()])
