"""The ValidatingAdmissionPolicy that confines a runtime ServiceAccount to its own pod's pdfleet.io conditions.

RBAC cannot say "only the pod this token belongs to": the runtime's Role names the deployment's pods
(``rbac.runtime_role``), which still lets one pod write a sibling's ``pdfleet.io/drained`` or gate.
The kubelet mounts pod-bound tokens (TokenRequest with ``boundObjectRef`` kind Pod); the apiserver
then puts the pod's name in the caller's user extra ``authentication.kubernetes.io/pod-name``. This
policy, for callers whose ServiceAccount is a runtime one (name ending ``-runtime``, as
``names.service_account_name`` makes it), denies a pods/status write unless

- the token is bound to the pod being written, in the ServiceAccount's own namespace (a token bound
  to no pod writes nothing), and
- every condition outside ``pdfleet.io/`` and the status fields that steer traffic (phase, pod IPs,
  container statuses, ...) are unchanged.

Installed cluster-wide by the chart (``charts/pdfleet/files/runtime-pod-status-policy.yaml`` is this
module's output; a unit test keeps them equal) and by the local cluster (``devcluster``).
"""

from __future__ import annotations

import yaml

from pdfleet_operator.api.constants import GROUP

__all__ = ["POLICY_NAME", "RUNTIME_SA_SUFFIX", "policy", "policy_binding", "policy_yaml"]

POLICY_NAME = f"runtime-pod-status.{GROUP}"
RUNTIME_SA_SUFFIX = "-runtime"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
# Status fields a runtime never writes; changing them would steer traffic (pod IPs feed endpoints).
FROZEN_STATUS = ("phase", "reason", "message", "podIP", "podIPs", "hostIP", "hostIPs", "startTime", "qosClass",
                 "nominatedNodeName", "containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses")


def _unchanged(field: str) -> str:
    new, old = f"object.status.{field}", f"oldObject.status.{field}"
    return f"(has({new}) == has({old}) && (!has({new}) || {new} == {old}))"


def _not_ours(side: str) -> str:
    return (f"has({side}.status) && has({side}.status.conditions) ? "
            f"{side}.status.conditions.filter(c, !c.type.startsWith('{GROUP}/')) : []")


def policy() -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": {"app.kubernetes.io/part-of": "pdfleet"}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods/status"],
            }]},
            "matchConditions": [{
                "name": "runtime-service-account",
                "expression": "request.userInfo.username.startsWith('system:serviceaccount:') && "
                              f"request.userInfo.username.endsWith('{RUNTIME_SA_SUFFIX}')",
            }],
            "variables": [
                {"name": "boundPod", "expression": f"'{POD_NAME_EXTRA}' in request.userInfo.extra ? "
                                                   f"request.userInfo.extra['{POD_NAME_EXTRA}'] : []"},
                {"name": "othersNow", "expression": _not_ours("object")},
                {"name": "othersBefore", "expression": _not_ours("oldObject")},
            ],
            "validations": [
                {"expression": "request.userInfo.username.startsWith('system:serviceaccount:' + "
                               "object.metadata.namespace + ':') && "
                               "variables.boundPod.exists(n, n == object.metadata.name)",
                 "messageExpression": "'a pdfleet runtime may write only the status of the pod its token is bound "
                                      "to (' + (size(variables.boundPod) > 0 ? variables.boundPod[0] : "
                                      "'a token bound to no pod') + '), not ' + object.metadata.name",
                 "reason": "Forbidden"},
                {"expression": "variables.othersNow == variables.othersBefore",
                 "message": f"a pdfleet runtime may change only {GROUP}/* pod conditions",
                 "reason": "Forbidden"},
                {"expression": "has(object.status) && has(oldObject.status) && "
                               + " && ".join(_unchanged(f) for f in FROZEN_STATUS),
                 "message": "a pdfleet runtime may not change pod status fields other than its "
                            f"{GROUP}/* conditions (phase, IPs, container statuses)",
                 "reason": "Forbidden"},
            ],
        },
    }


def policy_binding(namespaces: list[str] | None = None) -> dict:
    """The binding: every namespace, or only ``namespaces`` (the chart's managed ones)."""
    spec: dict = {"policyName": POLICY_NAME, "validationActions": ["Deny"]}
    if namespaces:
        spec["matchResources"] = {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]}}
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME, "labels": {"app.kubernetes.io/part-of": "pdfleet"}},
        "spec": spec,
    }


def policy_yaml() -> str:
    """The policy as the chart ships it (``charts/pdfleet/files/runtime-pod-status-policy.yaml``)."""
    header = ("# Generated from pdfleet_operator.resources.pod_status_policy (python -m "
              "pdfleet_operator.resources.pod_status_policy > this file); do not edit.\n")
    return header + yaml.safe_dump(policy(), sort_keys=False, width=120)


if __name__ == "__main__":
    print(policy_yaml(), end="")
