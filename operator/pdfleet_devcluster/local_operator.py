"""The operator as a local process against a LocalCluster, with the dev webhook.

Used by `pdfleet demo` and the cluster tests: ``python -m pdfleet_operator --standalone
--dev-webhook 127.0.0.1:PORT`` (kopf manages its own ValidatingWebhookConfiguration there and
removes its webhook again on SIGINT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdfleet_devcluster.cluster import ClusterError, LocalCluster, free_port
from pdfleet_runtime.lifetime import die_with_parent

__all__ = ["WEBHOOK_CONFIGURATION", "LocalOperator", "interrupt"]

# settings.AdmissionSettings().configuration_name, without importing kopf-facing settings here.
WEBHOOK_CONFIGURATION = "pdfleet-admission.pdfleet.io"


@dataclass
class LocalOperator:
    """One operator subprocess; ``log`` is its combined output (a new file per start)."""

    cluster: LocalCluster
    state_dir: Path
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    # False: no --standalone (pass --peering NAME to start: one of several replicas reconciles).
    standalone: bool = True
    # SIGKILLed when the process that started it dies (a killed test run leaves no operator behind).
    die_with_parent: bool = True
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

    def start(self, *args: str, timeout: float = 60.0) -> None:
        """Start it and wait until its webhook is published. A port taken between its choice and the operator's
        bind ("address already in use") is a start on other ports, at most three in all."""
        for attempt in range(3):
            try:
                return self._start(*args, timeout=timeout)
            except ClusterError:
                if attempt == 2 or "address already in use" not in self.log_text():
                    raise
                interrupt(self.proc)

    def _start(self, *args: str, timeout: float) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.port, self.metrics_port, self.args = free_port(), free_port(), args
        cmd = [
            sys.executable, "-m", "pdfleet_operator", *(["--standalone"] if self.standalone else []),
            "--dev-webhook", f"127.0.0.1:{self.port}",
            "--webhook-cert-dir", str(self.state_dir / "webhook"),
            "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            # One replica, whose webhook kopf removes on SIGINT: no Service moves the apiserver to a successor, so
            # the drain only has to answer the reviews in flight (milliseconds), not the default 5 s (args win).
            "--webhook-drain-seconds", "1",
            *args,
        ]  # fmt: skip
        env = {**os.environ, **self.extra_env, "KUBECONFIG": str(self.cluster.kubeconfig)}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.state_dir,
                                         preexec_fn=die_with_parent if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while not self._published():
            if time.monotonic() > deadline:
                raise ClusterError(f"the operator's webhook was not published within {timeout:.0f}s; log: {self.log}")
            time.sleep(0.2)

    def _published(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ClusterError(f"operator exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
        proc = self.cluster.kubectl(
            "get", "validatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "-o", "json", check=False
        )
        if proc.returncode != 0:
            return False
        hooks = json.loads(proc.stdout).get("webhooks") or []
        return any(f":{self.port}/" in h.get("clientConfig", {}).get("url", "") for h in hooks)

    def stop(self) -> None:
        interrupt(self.proc)

    def restart(self, *args: str) -> None:
        self.stop()
        self.start(*args)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def interrupt(proc: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> None:
    """Stop an operator process as kopf expects (SIGINT: it removes its webhook and finishes handlers),
    killing it only if it has not exited within ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
