"""The Helm chart on the real control plane: a server-side dry run of its output, then install, the
operator as a local process holding only a token of the chart's ServiceAccount (webhook served with
the chart's certificate at the chart's dev URL), an example reconciled to Available, an invalid one
denied by the chart's webhook, RBAC proven minimal, upgrade keeping PDDeployments and pods, uninstall
removing what the chart installed and keeping the CRD and PDDeployments.

Tests run in file order on one module-scoped release, like tests/cluster/test_reconcile.py.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster, toolchain
from pdfleet_devcluster.cluster import free_port
from pdfleet_devcluster.local_operator import interrupt
from pdfleet_operator.api.crd import CRD_NAME
from pdfleet_runtime.config import READINESS_GATE
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdfleet"
EXAMPLE = REPO / "examples" / "valid" / "llama-dense.yaml"
INVALID = REPO / "examples" / "invalid" / "nixl.replicated-hetero-tp.yaml"
RELEASE = "pdf"


@dataclass
class Release:
    cluster: LocalCluster
    system: str  # the release namespace (ServiceAccount, webhook Secret)
    apps: str  # the one namespace it manages
    port: int  # the dev webhook URL's port, where the local operator listens
    tmp: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def sa(self) -> str:
        return f"{RELEASE}-pdfleet"

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.system}:{self.sa}"

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "HELM_CACHE_HOME": str(self.tmp / "helm"),
               "HELM_CONFIG_HOME": str(self.tmp / "helm"), "HELM_DATA_HOME": str(self.tmp / "helm")}
        proc = subprocess.run([str(toolchain.binary("helm")), *args], capture_output=True, text=True, env=env,
                              timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def values(self) -> list[str]:
        return ["--set", f"watch.namespaces={{{self.apps}}}", "--set", f"webhook.url=https://127.0.0.1:{self.port}"]

    def get(self, ns: str, *args: str) -> dict:
        return json.loads(self.cluster.kubectl("-n", ns, "get", *args, "-o", "json").stdout)

    def sa_kubeconfig(self) -> Path:
        """A kubeconfig holding only a TokenRequest token of the chart's ServiceAccount."""
        token = self.cluster.kubectl("-n", self.system, "create", "token", self.sa, "--duration=1h").stdout.strip()
        kc = yaml.safe_load(self.cluster.kubeconfig.read_text())
        kc["users"] = [{"name": self.sa, "user": {"token": token}}]
        for ctx in kc["contexts"]:
            ctx["context"]["user"] = self.sa
        path = self.tmp / "sa.kubeconfig"
        path.write_text(yaml.safe_dump(kc))
        return path

    def webhook_certs(self) -> Path:
        """The chart's webhook certificate and key, written where an operator process reads them."""
        certs = self.tmp / "certs"
        certs.mkdir(exist_ok=True)
        data = self.get(self.system, "secret", f"{self.sa}-webhook-tls")["data"]
        for key in ("tls.crt", "tls.key"):
            (certs / key).write_bytes(base64.b64decode(data[key]))
        return certs

    def operator_env(self) -> dict[str, str]:
        """An operator process's environment: only the chart's token, this checkout's code."""
        env = {**os.environ, "KUBECONFIG": str(self.sa_kubeconfig())}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"), str(REPO),
                                             env.get("PYTHONPATH", "")])
        return env

    def start_operator(self) -> Path:
        log = self.tmp / "operator.log"
        cmd = [sys.executable, "-m", "pdfleet_operator", "--standalone", "--namespace", self.apps,
               "--webhook-listen", f"127.0.0.1:{self.port}", "--webhook-cert-dir", str(self.webhook_certs()),
               "--liveness", f"http://127.0.0.1:{free_port()}/healthz", "--resync-seconds", "3"]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.operator_env(),
                                         cwd=self.tmp)

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(listening, what=f"operator webhook on :{self.port}", timeout=60)
        return log

    def stop_operator(self) -> None:
        interrupt(self.proc)


def _namespace(cluster: LocalCluster, name: str, *labels: str) -> None:
    cluster.kubectl("create", "namespace", name)
    if labels:
        cluster.kubectl("label", "namespace", name, *labels)
    wait_until(lambda: cluster.kubectl("-n", name, "get", "sa", "default", check=False).returncode == 0,
               what=f"default ServiceAccount in {name}")


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    rel = Release(cluster, f"helm-sys-{suffix}", f"helm-apps-{suffix}", free_port(), tmp_path_factory.mktemp("helm"))
    # The release namespace enforces the restricted Pod Security Standard: the operator pod must pass it.
    _namespace(cluster, rel.system, "pod-security.kubernetes.io/enforce=restricted")
    _namespace(cluster, rel.apps)
    try:
        yield rel
    finally:
        rel.stop_operator()
        rel.helm("uninstall", RELEASE, "-n", rel.system, "--wait", check=False)
        cluster.kubectl("-n", rel.apps, "delete", "pdd", "--all", "--wait=false", check=False)
        for ns in (rel.apps, rel.system):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _pods(rel: Release) -> list[dict]:
    items = rel.get(rel.apps, "pods", "-l", "pdfleet.io/deployment=llama-dense")["items"]
    return [p for p in items if "deletionTimestamp" not in p["metadata"]]


def _condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == kind), {})


def test_template_passes_a_server_side_dry_run(release: Release) -> None:
    rel = release
    # The chart creates kopf peering objects; a dry run can check them only once their CRDs are served
    # (helm install applies crds/ first; a dry run of --include-crds cannot).
    rel.cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds" / "kopf.dev_peerings.yaml"))
    for crd in ("kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        rel.cluster.wait_established(crd)
    for extra in ([], ["--set", "watch.clusterWide=true"], ["--set", "webhook.enabled=false"]):
        out = rel.helm("template", RELEASE, str(CHART), "-n", rel.system, "--include-crds", *rel.values(), *extra)
        proc = rel.cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=out.stdout)
        applied = proc.stdout.splitlines()
        assert len(applied) >= 7 and all(line.endswith("(server dry run)") for line in applied), proc.stdout
        kinds = {line.split("/")[0].split(".")[0] for line in applied}
        assert {"customresourcedefinition", "deployment", "clusterrole", "serviceaccount"} <= kinds
        assert ("role" in kinds) == ("watch.clusterWide=true" not in extra), kinds
        assert ("validatingwebhookconfiguration" in kinds) == ("webhook.enabled=false" not in extra), kinds


def test_install(release: Release) -> None:
    rel = release
    # The test cluster already holds the runtime pod-status policy (LocalCluster.install_crd puts it there
    # with the CRD); a cluster has one per cluster, so the release adopts it as a first release would.
    rel.helm("install", RELEASE, str(CHART), "-n", rel.system, "--take-ownership", *rel.values())
    assert rel.cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    # The operator Deployment's pod passes the restricted Pod Security Standard (it is created at all).
    wait_until(lambda: rel.get(rel.system, "pods", "-l", "app.kubernetes.io/component=operator")["items"],
               what="operator pod admitted under pod-security restricted", timeout=60)
    hook = rel.get(rel.system, "validatingwebhookconfiguration", f"{RELEASE}-pdfleet-{rel.system}")["webhooks"][0]
    assert hook["clientConfig"]["url"] == f"https://127.0.0.1:{rel.port}/validate-pddeployment"


def test_local_operator_with_the_chart_token_reconciles_to_available(release: Release) -> None:
    rel = release
    log = rel.start_operator()
    rel.cluster.kubectl("-n", rel.apps, "apply", "-f", str(EXAMPLE))
    wait_until(lambda: len(_pods(rel)) == 3, what="1 prefill and 2 decode pods", timeout=60)
    wait_until(lambda: all(p["status"].get("phase") == "Running" for p in _pods(rel)), what="pods Running")
    for pod in _pods(rel):  # the runtime's part: its transfer-path condition through pods/status
        patch = {"status": {"conditions": [{"type": READINESS_GATE, "status": "True"}]}}
        rel.cluster.kubectl("-n", rel.apps, "patch", "pod", pod["metadata"]["name"], "--subresource=status",
                            "--type=strategic", "-p", json.dumps(patch))
    pdd = wait_until(lambda: (o := rel.get(rel.apps, "pdd", "llama-dense")) and
                     _condition(o, "Available").get("status") == "True" and o,
                     what="Available", timeout=60)
    assert pdd["status"]["decodeReady"] == "2/2"
    text = log.read_text()
    said = re.sub(r"^\[[^\]]*\]", "", text, flags=re.M)  # each line's timestamp off: its milliseconds can read 403
    assert "Forbidden" not in said and "403" not in said, text[-3000:]


def test_the_charts_webhook_denies_an_invalid_example(release: Release) -> None:
    rel = release
    proc = rel.cluster.kubectl("-n", rel.apps, "apply", "-f", str(INVALID), check=False)
    assert proc.returncode != 0
    assert 'admission webhook "validate-pddeployment.pdfleet.io" denied the request' in proc.stderr, proc.stderr
    assert "[nixl.replicated-hetero-tp]" in proc.stderr


@pytest.mark.parametrize(
    ("verb", "resource", "where", "allowed"),
    [
        ("get", "secrets", "apps", True),  # the checks below can fail: the same account can do this
        ("create", "secrets", "apps", True),
        ("list", "secrets", "apps", False),  # only its own secret, by name
        ("create", "controllerrevisions.apps", "apps", True),
        ("create", "pods", "apps", True),
        ("own-pods", "pddeployments.pdfleet.io", "apps", True),  # the pod-labels policy asks for it
        ("own-pods", "pddeployments.pdfleet.io", "default", False),
        ("patch", "pods/status", "apps", True),
        ("get", "secrets", "kube-system", False),
        ("list", "secrets", "kube-system", False),
        ("list", "secrets", "system", False),  # not even in its own release namespace
        ("list", "secrets", "-A", False),
        ("create", "pods", "default", False),
        ("list", "pddeployments.pdfleet.io", "default", False),
        ("create", "validatingwebhookconfigurations", "", False),
        ("patch", "validatingwebhookconfigurations", "", False),
        ("delete", "validatingwebhookconfigurations", "", False),
        ("create", "mutatingwebhookconfigurations", "", False),
        ("create", "namespaces", "", False),
        ("delete", "namespaces", "", False),
        ("patch", "namespaces", "", False),
        ("create", "clusterroles", "", False),
        ("delete", "pddeployments.pdfleet.io", "apps", False),
        ("update", "customresourcedefinitions", "", False),
        ("escalate", "roles", "apps", False),
    ],
)
def test_service_account_is_least_privilege(release: Release, verb: str, resource: str, where: str,
                                            allowed: bool) -> None:
    rel = release
    scope = {"apps": ["-n", rel.apps], "system": ["-n", rel.system], "-A": ["-A"], "": []}.get(where, ["-n", where])
    proc = rel.cluster.kubectl("auth", "can-i", verb, resource, *scope, f"--as={rel.user}", check=False)
    assert proc.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, where, proc.stdout, proc.stderr)


def test_the_token_itself_is_refused_outside_scope(release: Release) -> None:
    rel = release
    kc = str(rel.sa_kubeconfig())
    proc = rel.cluster.kubectl("--kubeconfig", kc, "-n", "kube-system", "get", "secrets", check=False)
    assert proc.returncode != 0 and "Forbidden" in proc.stderr, proc.stderr
    proc = rel.cluster.kubectl("--kubeconfig", kc, "delete", "validatingwebhookconfiguration",
                               f"{RELEASE}-pdfleet-{rel.system}", "--dry-run=server", check=False)
    assert proc.returncode != 0 and "Forbidden" in proc.stderr, proc.stderr
    proc = rel.cluster.kubectl("--kubeconfig", kc, "-n", rel.apps, "get", "secret", "llama-dense-transfer-auth")
    assert "llama-dense" in proc.stdout  # the per-deployment secret it created is readable to it


def test_upgrade_with_changed_values_keeps_deployments_and_pods(release: Release) -> None:
    rel = release
    uid = rel.get(rel.apps, "pdd", "llama-dense")["metadata"]["uid"]
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in _pods(rel)}
    secret = rel.get(rel.system, "secret", f"{rel.sa}-webhook-tls")["data"]
    # The documented CRD upgrade step (Helm never upgrades crds/), then the upgrade itself.
    rel.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    rel.helm("upgrade", RELEASE, str(CHART), "-n", rel.system, *rel.values(),
             "--set", "operator.resyncSeconds=7", "--set", "deployment.resources.limits.memory=640Mi")
    dep = rel.get(rel.system, "deployment", rel.sa)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--resync-seconds=7" in container["args"] and container["resources"]["limits"]["memory"] == "640Mi"
    assert rel.get(rel.system, "secret", f"{rel.sa}-webhook-tls")["data"] == secret  # same certificate
    assert rel.get(rel.apps, "pdd", "llama-dense")["metadata"]["uid"] == uid
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in _pods(rel)} == pods
    # The webhook still answers with the kept certificate (caBundle unchanged).
    proc = rel.cluster.kubectl("-n", rel.apps, "apply", "-f", str(INVALID), check=False)
    assert "denied the request" in proc.stderr, proc.stderr


def test_uninstall_removes_the_chart_and_keeps_crd_and_deployments(release: Release) -> None:
    rel = release
    pods = {p["metadata"]["uid"] for p in _pods(rel)}
    rel.helm("uninstall", RELEASE, "-n", rel.system, "--wait")
    k = rel.cluster.kubectl
    gone = [
        ("-n", rel.system, "get", "deployment", rel.sa),
        ("-n", rel.system, "get", "serviceaccount", rel.sa),
        ("-n", rel.system, "get", "secret", f"{rel.sa}-webhook-tls"),
        ("-n", rel.apps, "get", "role", rel.sa),
        ("-n", rel.apps, "get", "rolebinding", rel.sa),
        ("get", "clusterrole", f"{RELEASE}-pdfleet-{rel.system}-observe"),
        ("get", "clusterrolebinding", f"{RELEASE}-pdfleet-{rel.system}-observe"),
        ("get", "validatingwebhookconfiguration", f"{RELEASE}-pdfleet-{rel.system}"),
    ]
    for args in gone:
        wait_until(lambda a=args: k(*a, check=False).returncode != 0, what=f"{' '.join(args)} removed", timeout=30)
    assert k("get", "crd", CRD_NAME, check=False).returncode == 0
    assert rel.get(rel.apps, "pdd", "llama-dense")["metadata"]["name"] == "llama-dense"
    assert {p["metadata"]["uid"] for p in _pods(rel)} == pods
    # With the webhook configuration gone, nothing blocks PDDeployment writes any more.
    k("-n", rel.apps, "label", "pdd", "llama-dense", "uninstalled=yes")
