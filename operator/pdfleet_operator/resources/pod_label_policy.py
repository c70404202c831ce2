"""The ValidatingAdmissionPolicy that lets only the operator put a deployment's label on a pod.

The routers discover workers by label, and the workers' NetworkPolicy admits every pod carrying the
deployment label on every port: a pod that carries ``pdfleet.io/deployment=<name>`` receives the
deployment's prompts and the router's worker key (issue 39; docs/security.md). Kubernetes lets whoever
may create pods in a namespace set any label, so this policy asks one more question of a request that
creates a pod carrying that label, or changes the labels of a pod that carries it: may the caller
``own-pods`` the PDDeployment the label names? RBAC verbs are free-form; the operator's role holds
this one on ``pddeployments`` (the chart's ``pdfleet.rules``), cluster admins hold every verb, and a
tenant allowed to create pods does not. An update that leaves the labels as they were (the garbage
collector's ownerReferences, a finalizer) is not asked.

Installed cluster-wide by the chart (``charts/pdfleet/files/pod-label-policy.yaml`` is this module's
output; a unit test keeps them equal) and by the local cluster (``devcluster``).
"""

from __future__ import annotations

import yaml

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, PLURAL

__all__ = ["OWN_PODS_VERB", "POLICY_NAME", "policy", "policy_binding", "policy_yaml"]

POLICY_NAME = f"pod-labels.{GROUP}"
OWN_PODS_VERB = "own-pods"
"""The RBAC verb on ``pddeployments`` (by name) that lets a caller make or relabel the deployment's pods."""


def _carries(side: str) -> str:
    return f"has({side}.metadata.labels) && '{LABEL_DEPLOYMENT}' in {side}.metadata.labels"


def _labels(side: str) -> str:
    return f"(has({side}.metadata.labels) ? {side}.metadata.labels : {{}})"


def policy() -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": {"app.kubernetes.io/part-of": "pdfleet"}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"],
            }]},
            "matchConditions": [{
                "name": "carries-a-deployment-label",
                "expression": f"({_carries('object')}) || (oldObject != null && {_carries('oldObject')})",
            }],
            "variables": [
                {"name": "deployment", "expression": f"{_carries('object')} ? "
                                                     f"object.metadata.labels['{LABEL_DEPLOYMENT}'] : "
                                                     f"oldObject.metadata.labels['{LABEL_DEPLOYMENT}']"},
                {"name": "labelsUnchanged", "expression": f"oldObject != null && {_labels('object')} == "
                                                          f"{_labels('oldObject')}"},
            ],
            "validations": [{
                "expression": f"variables.labelsUnchanged || authorizer.group('{GROUP}').resource('{PLURAL}')"
                              f".namespace(request.namespace).name(variables.deployment)"
                              f".check('{OWN_PODS_VERB}').allowed()",
                "messageExpression": f"'only the pdfleet operator may create a pod labelled {LABEL_DEPLOYMENT}=' + "
                                     f"variables.deployment + ' or change the labels of such a pod: the routers send "
                                     f"those pods prompts and the worker key (RBAC verb {OWN_PODS_VERB} on "
                                     f"{PLURAL}.{GROUP}/' + variables.deployment + ', docs/security.md)'",
                "reason": "Forbidden",
            }],
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
    """The policy as the chart ships it (``charts/pdfleet/files/pod-label-policy.yaml``)."""
    header = ("# Generated from pdfleet_operator.resources.pod_label_policy (python -m "
              "pdfleet_operator.resources.pod_label_policy > this file); do not edit.\n")
    return header + yaml.safe_dump(policy(), sort_keys=False, width=120)


if __name__ == "__main__":
    print(policy_yaml(), end="")
