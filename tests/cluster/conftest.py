"""Cluster fixtures beyond the control plane: the CRD installed, and the operator as a subprocess.

``operator`` runs ``python -m pdfleet_operator --dev-webhook 127.0.0.1:PORT`` against the test
cluster (kopf manages its own ValidatingWebhookConfiguration there) and stops it with SIGINT at
teardown, so kopf removes its webhook from the configuration on the way out. Tests can restart it
with other flags (``restart(*args)``), e.g. the re-check's ``--test-deny-cell`` hook.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdfleet_operator.api.crd import CRD_FILE, CRD_NAME
from pdfleet_operator.devcluster import LocalCluster
from pdfleet_operator.devcluster.cluster import free_port
from pdfleet_operator.settings import AdmissionSettings
from tests.helpers import wait_until

WEBHOOK_CONFIGURATION = AdmissionSettings().configuration_name
REPO = Path(__file__).resolve().parents[2]


@dataclass
class OperatorProcess:
    """One operator subprocess with the dev webhook; ``log`` is its combined output."""

    cluster: LocalCluster
    state_dir: Path
    port: int = 0
    args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.state_dir / f"operator-{self.starts}.log"

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "webhook" / "ca.crt"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self, *args: str) -> None:
        self.starts += 1
        self.port, self.args = free_port(), args
        cmd = [
            sys.executable, "-m", "pdfleet_operator", "--standalone",
            "--dev-webhook", f"127.0.0.1:{self.port}",
            "--webhook-cert-dir", str(self.state_dir / "webhook"),
            "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
            *args,
        ]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "runtime"), str(REPO / "operator"), str(REPO), env.get("PYTHONPATH", "")]
        )
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.state_dir)
        wait_until(self._published, what=f"webhook at :{self.port} published (log: {self.log})", timeout=60)

    def _published(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        proc = self.cluster.kubectl(
            "get", "validatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "-o", "json", check=False
        )
        if proc.returncode != 0:
            return False
        hooks = json.loads(proc.stdout).get("webhooks") or []
        return any(f":{self.port}/" in h.get("clientConfig", {}).get("url", "") for h in hooks)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, *args: str) -> None:
        self.stop()
        self.start(*args)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> str:
    """The generated CRD, applied and served (discovery included)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=70)
    wait_until(lambda: cluster.kubectl("get", "pdd", "-A", check=False).returncode == 0, what="pdd discovery")
    return CRD_NAME


@pytest.fixture(scope="module")
def operator(
    cluster: LocalCluster, crd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
