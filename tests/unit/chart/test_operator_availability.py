"""The chart's operator cannot be pushed over (issue 26, item 4; the runtime policy of item 1 at the end): two replicas, both serving the webhook
through its Service (certificate for the Service's DNS name), kopf peering keeping one reconciling,
a PodDisruptionBudget, and a NetworkPolicy that admits only the webhook (and, if asked, metrics)."""

from __future__ import annotations

import importlib

import pytest
import yaml

from pdfleet_operator.admission.handlers import VALIDATE_WEBHOOK_ID
from tests.unit.chart.conftest import CHART, NAMESPACE, Render, by_kind, one

SELECTOR = {"app.kubernetes.io/name": "pdfleet", "app.kubernetes.io/instance": "rel",
            "app.kubernetes.io/component": "operator"}


def _args(objs: list[dict]) -> list[str]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_two_replicas_with_peering_and_a_rolling_update_that_keeps_the_webhook(render: Render) -> None:
    objs = render()
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    args = _args(objs)
    assert "--standalone" not in args
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    # The peering object kopf keeps its keep-alives in exists in the managed namespace.
    (obj,) = [o for o in by_kind(objs, "KopfPeering") if o["metadata"]["name"] == peering]
    assert obj["metadata"]["namespace"] == NAMESPACE
    # Both replicas serve the webhook: the Service selects every operator pod, not one.
    svc = one(objs, "Service")
    assert svc["spec"]["selector"] == SELECTOR
    hook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["service"]["name"] == svc["metadata"]["name"]
    assert hook["clientConfig"]["service"]["path"] == f"/{VALIDATE_WEBHOOK_ID}"
    # Spread over nodes by default.
    affinity = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == SELECTOR


def test_peering_crds_and_rbac(render: Render) -> None:
    names = sorted(p.name for p in (CHART / "crds").iterdir())
    assert "kopf.dev_peerings.yaml" in names
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text()))
    assert sorted(c["spec"]["names"]["kind"] for c in crds) == ["ClusterKopfPeering", "KopfPeering"]
    objs = render("watch.namespaces={a,b}")
    assert sorted(o["metadata"]["namespace"] for o in by_kind(objs, "KopfPeering")) == ["a", "b"]
    for role in by_kind(objs, "Role"):
        rules = [r for r in role["rules"] if "kopf.dev" in r["apiGroups"]]
        assert rules and set(rules[0]["verbs"]) == {"get", "list", "watch", "patch"}
        assert rules[0]["resources"] == ["kopfpeerings"]
    wide = render("watch.clusterWide=true")
    assert not by_kind(wide, "KopfPeering") and len(by_kind(wide, "ClusterKopfPeering")) == 1


def test_a_disruption_budget_keeps_one_replica(render: Render) -> None:
    pdb = one(render(), "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == SELECTOR
    assert pdb["spec"]["maxUnavailable"] == 1
    assert not by_kind(render("deployment.replicas=1"), "PodDisruptionBudget")  # it would block every drain


def test_network_policy_admits_only_the_webhook(render: Render) -> None:
    objs = render()
    (np,) = [n for n in by_kind(objs, "NetworkPolicy") if n["spec"]["podSelector"]["matchLabels"] == SELECTOR]
    assert sorted(np["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    (ingress,) = np["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 9443, "protocol": "TCP"}]
    egress_ports = {(p["port"], p["protocol"]) for rule in np["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {(53, "UDP"), (53, "TCP"), (443, "TCP"), (6443, "TCP")}
    scraped = one(render("networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring"),
                  "NetworkPolicy")
    assert [r["ports"] for r in scraped["spec"]["ingress"]][1] == [{"port": 8081, "protocol": "TCP"}]
    assert not by_kind(render("networkPolicy.enabled=false"), "NetworkPolicy")


@pytest.mark.parametrize("module, file", [("pod_status_policy", "runtime-pod-status-policy.yaml"),
                                          ("pod_label_policy", "pod-label-policy.yaml")])
def test_the_policies_are_the_generated_ones(render: Render, module: str, file: str) -> None:
    mod = importlib.import_module(f"pdfleet_operator.resources.{module}")
    assert (CHART / "files" / file).read_text() == mod.policy_yaml(), (
        f"charts/pdfleet/files/{file} is stale: python -m pdfleet_operator.resources.{module} > "
        f"charts/pdfleet/files/{file}")
    objs = render("watch.namespaces={a,b}")
    (pol,) = [o for o in by_kind(objs, "ValidatingAdmissionPolicy") if o["metadata"]["name"] == mod.POLICY_NAME]
    assert pol == mod.policy()
    (binding,) = [o for o in by_kind(objs, "ValidatingAdmissionPolicyBinding")
                  if o["spec"]["policyName"] == mod.POLICY_NAME]
    assert binding["spec"]["validationActions"] == ["Deny"]
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]
    assert selector["values"] == ["a", "b"]
    assert not by_kind(render("runtimePolicy.install=false"), "ValidatingAdmissionPolicy")
