"""The Helm chart, rendered offline: lint, the values schema, the CRD copy, pod security, RBAC derived
from what the operator code does (child kinds, the runtime Role it grants), and the webhook's three
certificate/endpoint modes. The real-cluster behaviour is in tests/cluster/test_helm.py.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography import x509

from pdfleet_operator.admission.handlers import VALIDATE_WEBHOOK_ID
from pdfleet_operator.api.crd import CRD_FILE, ROLESCALE_CRD_FILE
from pdfleet_operator.reconcile import CHILD_KINDS
from pdfleet_operator.resources.rbac import runtime_role
from tests.unit.chart.conftest import CHART, NAMESPACE, Render, by_kind, helm_run, one

VALUE_SETS = {
    "default": (),
    "namespaces": ("watch.namespaces={a,b}",),
    "cluster-wide": ("watch.clusterWide=true",),
    "dev-url": ("webhook.url=https://127.0.0.1:9555", "deployment.enabled=false"),
    "cert-manager": ("webhook.certificate.source=cert-manager",),
    "service-monitor": ("serviceMonitor.enabled=true",),
    "monitoring": ("podMonitor.enabled=true", "prometheusRule.enabled=true", "grafanaDashboard.enabled=true"),
    "no-webhook": ("webhook.enabled=false",),
}


def _granted(rules: list[dict], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for r in rules:
        if group in r["apiGroups"] and resource in r["resources"]:
            verbs |= set(r["verbs"])
    return verbs


def test_chart_crd_is_the_generated_crd() -> None:
    # Helm installs crds/ from the chart; a stale copy would install an older schema than the operator's.
    assert (CHART / "crds" / CRD_FILE.name).read_bytes() == CRD_FILE.read_bytes(), (
        "charts/pdfleet/crds is stale: cp crds/*.yaml charts/pdfleet/crds/"
    )
    # Besides it only kopf's peering CRDs (tests/unit/chart/test_operator_availability.py).
    assert (CHART / "crds" / ROLESCALE_CRD_FILE.name).read_bytes() == ROLESCALE_CRD_FILE.read_bytes()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(
        [CRD_FILE.name, ROLESCALE_CRD_FILE.name, "kopf.dev_peerings.yaml"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(helm: Path, name: str) -> None:
    args = [a for s in VALUE_SETS[name] for a in ("--set", s)]
    proc = helm_run(helm, "lint", "--strict", str(CHART), "-n", NAMESPACE, *args)
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("webhook.failurePolicy=Maybe", "failurePolicy"),
        ("webhook.url=http://127.0.0.1:9443", "url"),
        ("webhook.url=https://h:1/some/path", "url"),
        ("watch.namespaces={Bad_Name}", "namespaces"),
        ("operator.resyncSeconds=0", "resyncSeconds"),
        ("webhook.certificate.source=vault", "source"),
        ("deployment.replicas=0", "replicas"),
        ("surprise=1", "surprise"),
    ],
)
def test_schema_rejects_bad_values(helm: Path, setting: str, complaint: str) -> None:
    proc = helm_run(helm, "template", "r", str(CHART), "--set", setting, check=False)
    assert proc.returncode != 0, f"{setting} was accepted"
    assert "schema" in proc.stderr and complaint in proc.stderr, proc.stderr


def test_operator_pod_is_locked_down(render: Render) -> None:
    dep = one(render(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork") and not sc.get("privileged")
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/etc/pdfleet/webhook"}


def test_namespaced_rbac_covers_what_the_operator_does(render: Render) -> None:
    objs = render("watch.namespaces={a,b}")
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objs, "RoleBinding")) == ["a", "b"]
    rules = roles[0]["rules"]
    for api_version, plural in CHILD_KINDS:  # every child kind the operator watches
        group = api_version.rpartition("/")[0]
        assert {"get", "list", "watch", "create"} <= _granted(rules, group, plural), plural
    # RBAC escalation prevention: the operator may only grant the runtime what it holds itself.
    for rule in runtime_role("x", "a", ["x-decode-0"])["rules"]:
        for res in rule["resources"]:
            assert set(rule["verbs"]) <= _granted(rules, rule["apiGroups"][0], res), res
    assert _granted(rules, "pdfleet.io", "pddeployments/status") == {"get", "patch"}
    assert _granted(rules, "pdfleet.io", "pdrolescales/status") == {"get", "patch"}
    assert "patch" not in _granted(rules, "pdfleet.io", "pdrolescales")  # its spec.replicas is the HPA's
    assert "delete" not in _granted(rules, "pdfleet.io", "pddeployments")
    assert _granted(rules, "", "secrets") == {"get", "create"}  # read its own by name, create once; no list
    assert _granted(rules, "apps", "controllerrevisions") == {"get", "list", "watch", "create"}
    assert _granted(rules, "apps", "deployments") == {"get", "list", "watch", "create", "patch"}  # the router
    dep = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in dep and "--namespace=b" in dep and "--all-namespaces" not in dep
    hook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["a", "b"]


def test_default_scope_is_the_release_namespace(render: Render) -> None:
    objs = render()
    assert [r["metadata"]["namespace"] for r in by_kind(objs, "Role")] == [NAMESPACE]


def test_cluster_roles_are_read_only_without_secrets(render: Render) -> None:
    for name in ("default", "namespaces"):
        objs = render(*VALUE_SETS[name])
        (cr,) = by_kind(objs, "ClusterRole")
        for rule in cr["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            assert "secrets" not in rule["resources"] and "*" not in rule["resources"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_rbac_on_webhook_configurations_or_wildcards(render: Render, name: str) -> None:
    for obj in render(*VALUE_SETS[name]):
        for rule in obj.get("rules") or () if obj["kind"] in ("Role", "ClusterRole") else ():
            assert "admissionregistration.k8s.io" not in rule["apiGroups"]
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_cluster_wide_uses_a_cluster_role(render: Render) -> None:
    objs = render("watch.clusterWide=true", "watch.namespaces={a}")
    assert not by_kind(objs, "Role")
    (main,) = [c for c in by_kind(objs, "ClusterRole") if not c["metadata"]["name"].endswith("-observe")]
    assert "secrets" in {r for rule in main["rules"] for r in rule["resources"]}
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    assert "namespaceSelector" not in one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]


def _cert(b64: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(b64))


def test_generated_certificate_serves_the_service(render: Render) -> None:
    objs = render()
    secret = one(objs, "Secret")
    hook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    svc = one(objs, "Service")
    assert hook["clientConfig"]["service"] == {
        "name": svc["metadata"]["name"], "namespace": NAMESPACE, "port": 443, "path": f"/{VALIDATE_WEBHOOK_ID}",
    }
    assert hook["failurePolicy"] == "Fail" and hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    ca, leaf = _cert(hook["clientConfig"]["caBundle"]), _cert(secret["data"]["tls.crt"])
    assert secret["data"]["ca.crt"] == hook["clientConfig"]["caBundle"]
    leaf.verify_directly_issued_by(ca)
    dns = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{svc['metadata']['name']}.{NAMESPACE}.svc" in dns


def test_dev_url_points_the_apiserver_at_a_local_process(render: Render) -> None:
    objs = render(*VALUE_SETS["dev-url"])
    assert not by_kind(objs, "Service") and not by_kind(objs, "Deployment")
    hook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["url"] == f"https://127.0.0.1:9555/{VALIDATE_WEBHOOK_ID}"
    assert "service" not in hook["clientConfig"]
    leaf = _cert(one(objs, "Secret")["data"]["tls.crt"])
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    named = render("webhook.url=https://op.example.test:8443/")
    hook = one(named, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["url"] == f"https://op.example.test:8443/{VALIDATE_WEBHOOK_ID}"
    san = _cert(one(named, "Secret")["data"]["tls.crt"]).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "op.example.test" in san.value.get_values_for_type(x509.DNSName)


def test_cert_manager_mode(render: Render) -> None:
    objs = render(*VALUE_SETS["cert-manager"])
    assert not by_kind(objs, "Secret")  # cert-manager writes it
    cert, issuer = one(objs, "Certificate"), one(objs, "Issuer")
    assert cert["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{cert['metadata']['name']}"
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]
    volumes = one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert cert["spec"]["secretName"] in {v.get("secret", {}).get("secretName") for v in volumes}
    external = render(*VALUE_SETS["cert-manager"], "webhook.certManager.issuerRef.kind=ClusterIssuer",
                      "webhook.certManager.issuerRef.name=corp-ca")
    assert not by_kind(external, "Issuer")
    assert one(external, "Certificate")["spec"]["issuerRef"]["name"] == "corp-ca"


def test_service_monitor_is_optional(render: Render) -> None:
    assert not by_kind(render(), "ServiceMonitor")
    sm = one(render("serviceMonitor.enabled=true", "watch.namespaces={a}"), "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["a"]}
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


def test_no_webhook_means_no_certificate_or_listener(render: Render) -> None:
    objs = render(*VALUE_SETS["no-webhook"])
    assert not by_kind(objs, "ValidatingWebhookConfiguration") and not by_kind(objs, "Secret")
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--webhook") for a in args)


def test_the_operators_pods_carry_what_every_deployments_policy_admits_to_the_metrics_port(render: Render) -> None:
    """Each PDDeployment's NetworkPolicy admits the operator's pods (any namespace) to the port its autoscaler scrapes
    (resources/policy.py); the chart's pods must carry those labels, in every release."""
    from pdfleet_operator.resources.policy import OPERATOR_LABELS

    for objs in (render(),):
        labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert OPERATOR_LABELS.items() <= labels.items(), labels
