"""Kueue's manager beside a local cluster, for the tests that need real gang admission (opt-in: nothing
else starts it, and ``pdfleet dev build`` never builds it; ``kueue.ensure_kueue`` does, on first use).

What a Kueue install does, shrunk to one process in the cluster's private namespace:

* Kueue's own CRDs (from the module, ``kueue.CONFIG_FILES``) applied server-side (they exceed the
  client-side annotation limit);
* its webhook configurations rewritten to ``https://127.0.0.1:<port>`` with our CA, keeping only the pod
  webhooks and Kueue's own kinds (the other frameworks are off: a webhook left for them would refuse every
  Job with a 404), and the pod webhooks scoped to namespaces labelled ``NAMESPACE_LABEL`` so a stopped
  Kueue never blocks another test's pods;
* a configuration with the ``pod`` integration only, no leader election, internal certificate management
  off (our certificates in its cert dir), the same namespace label as ``managedJobsNamespaceSelector``;
* its metrics certificate, which Kueue reads from a fixed path (``/etc/kueue/metrics/certs``): a tmpfs
  mounted there in the cluster's private mount namespace, as the sandbox does for ``/etc/netns``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdfleet_devcluster.cluster import LocalCluster, free_port
from pdfleet_devcluster.kueue import ensure_kueue
from pdfleet_operator.cachedbuild import die_with_parent
from pdfleet_operator.certs import CertificateAuthority

__all__ = ["KUEUE_NAMESPACE", "NAMESPACE_LABEL", "KueueProcess", "release_pods", "start_kueue"]

KUEUE_NAMESPACE = "kueue-system"
NAMESPACE_LABEL = "pdfleet.io/kueue"  # namespaces whose pods Kueue manages: label them "true"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
_OWN_GROUPS = {"", "kueue.x-k8s.io"}  # pods, and Kueue's own kinds


@dataclass
class KueueProcess:
    proc: subprocess.Popen
    log: Path
    webhook_port: int

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def release_pods(cluster: LocalCluster) -> list[str]:
    """Drop Kueue's finalizer from every pod that still has it (before Kueue stops: without Kueue nothing
    would, and deleted pods would hold their nodes' GPUs for the rest of the cluster's life). Returns them."""
    listing = json.loads(cluster.kubectl("get", "pods", "-A", "-l", "kueue.x-k8s.io/managed=true", "-o", "json").stdout)
    released = []
    for pod in listing["items"]:
        meta = pod["metadata"]
        kept = [f for f in meta.get("finalizers") or () if not f.startswith("kueue.x-k8s.io/")]
        if kept != (meta.get("finalizers") or []):
            cluster.kubectl("-n", meta["namespace"], "patch", "pod", meta["name"], "--type=merge",
                            "-p", json.dumps({"metadata": {"finalizers": kept or None}}), check=False)
            released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def _metrics_certs(ca: CertificateAuthority) -> None:
    """Kueue's fixed metrics certificate path, on a tmpfs private to this mount namespace."""
    root = METRICS_CERTS.parents[1]  # /etc/kueue
    if not _mounted(root):
        os.makedirs(root, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", str(root)], check=True)
    METRICS_CERTS.mkdir(parents=True, exist_ok=True)
    pair = ca.issue("metrics", common_name="kueue-metrics")
    shutil.copyfile(pair.cert_path, METRICS_CERTS / "tls.crt")
    shutil.copyfile(pair.key_path, METRICS_CERTS / "tls.key")


def _webhooks(manifests: Path, port: int, ca_pem: bytes) -> list[dict]:
    """Kueue's webhook configurations for the pod integration and its own kinds, served at 127.0.0.1."""
    bundle = base64.b64encode(ca_pem).decode()
    out = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or ():
            if not all(g in _OWN_GROUPS for r in hook.get("rules") or () for g in r.get("apiGroups") or ()):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            if any("pods" in r.get("resources", ()) for r in hook.get("rules") or ()):
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
            kept.append(hook)
        doc["webhooks"] = kept
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        out.append(doc)
    return out


def _config(state: Path, port: int, health: int, certs: Path) -> Path:
    cfg = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
        "integrations": {"frameworks": ["pod"]},
    }
    path = state / "kueue-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _ready(health: int) -> bool:
    url = f"http://127.0.0.1:{health}/readyz"
    with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)
    return False


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def start_kueue(cluster: LocalCluster, state: Path, *, timeout: float = 180.0) -> KueueProcess:
    """Install Kueue's CRDs and webhooks into ``cluster`` and start its manager (the caller stops it)."""
    bin_dir = ensure_kueue()
    config = bin_dir.parent / "config"
    state.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority(state / "ca", name="kueue-dev-ca")
    certs = state / "serving"
    certs.mkdir(exist_ok=True)
    serving = ca.issue("serving", common_name="kueue-webhook")
    shutil.copyfile(serving.cert_path, certs / "tls.crt")
    shutil.copyfile(serving.key_path, certs / "tls.key")
    _metrics_certs(ca)
    port, health = free_port(), free_port()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(config / "bases"), timeout=120)
    for crd in sorted(p.stem for p in (config / "bases").glob("*.yaml")):
        cluster.wait_established(crd.split("_", 1)[1] + "." + crd.split("_", 1)[0], timeout=60)
    cluster.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)
    for doc in _webhooks(config / "manifests.yaml", port, ca.cert_pem):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(doc))
    log = state / "kueue.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(bin_dir / "kueue"), f"--config={_config(state, port, health, certs)}",
             "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
    kueue = KueueProcess(proc, log, port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kueue exited with {proc.returncode}; log {log}:\n{kueue.tail()}")
        if _ready(health) and _listening(port):
            return kueue
        time.sleep(0.5)
    kueue.stop()
    raise RuntimeError(f"kueue not ready after {timeout:.0f}s; log {log}:\n{kueue.tail()}")
