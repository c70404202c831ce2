"""``helm upgrade`` of pdfleet itself while two fleets serve traffic (issue 47).

The chart is installed into the local cluster watching two namespaces, each with a fleet of real runtime pods
behind its router. Its operator runs as the Deployment would run it, as local processes holding only a token
of the chart's ServiceAccount: two replicas peered through the chart's KopfPeering objects, each serving the
webhook with the chart's certificate behind a loopback TCP front that plays the webhook Service (it sends each
connection to a replica that is up, in turn; a replica leaves it before it stops, as a terminating pod leaves
its Service's endpoints).

The upgrade is the chart's documented one (the CRD applied, then ``helm upgrade`` with changed values), then
the Deployment's rolling update (``maxSurge: 1, maxUnavailable: 0``): a new replica starts with the upgraded
release's arguments before each old one stops. Throughout: chat traffic through both routers, and an apply
through the webhook every half second. Afterwards: zero failed client requests, zero denied or failed applies,
the webhook's certificate and the CRD's stored versions unchanged, the fleets still Available, and no pod
restarted or replaced (the upgrade renders the same pods).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.cluster import free_port
from pdfleet_devcluster.local_operator import interrupt
from pdfleet_operator.api.crd import CRD_NAME
from tests.cluster.test_helm import CHART, RELEASE, Release, _namespace
from tests.e2e.traffic import NAME, Fleet, running_fleet
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster


class Front:
    """The webhook Service: a loopback TCP listener that pipes each connection to a replica that is up."""

    def __init__(self, port: int) -> None:
        self.port, self.backends, self._lock, self._turn = port, list[int](), threading.Lock(), 0
        self._sock = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            order = self.backends[self._turn % len(self.backends):] + self.backends[:self._turn % len(self.backends)] \
                if self.backends else []
            self._turn += 1
        for port in order:
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                continue
        else:
            client.close()
            return
        upstream.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        t.start()
        pump(client, upstream)
        t.join(30)
        client.close()
        upstream.close()

    def close(self) -> None:
        self._sock.close()


class Replica:
    """One operator replica as the chart's Deployment runs it: the chart's token, peering, the webhook."""

    def __init__(self, rel: Release, name: str, namespaces: list[str], resync: int) -> None:
        self.rel, self.name, self.port = rel, name, free_port()
        self.log = rel.tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "pdfleet_operator", f"--peering={RELEASE}-pdfleet-{rel.system}",
               *(f"--namespace={ns}" for ns in namespaces), "--webhook-listen", f"127.0.0.1:{self.port}",
               "--webhook-cert-dir", str(rel.webhook_certs()), "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
               f"--resync-seconds={resync}", "--metrics-listen", f"127.0.0.1:{free_port()}"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=rel.operator_env(),
                                         cwd=rel.tmp)

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{name} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        try:
            wait_until(listening, what=f"{name}'s webhook on :{self.port}", timeout=90)
        except BaseException:
            self.stop()  # a replica that never listened is not left running
            raise

    def stop(self) -> None:
        interrupt(self.proc)


class Applier:
    """An apply through the webhook every half second (an annotation on each fleet's PDDeployment)."""

    def __init__(self, cluster: LocalCluster, namespaces: list[str]) -> None:
        self.cluster, self.namespaces, self.sent, self.refused = cluster, namespaces, 0, list[str]()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            ns = self.namespaces[self.sent % len(self.namespaces)]
            self.sent += 1
            out = self.cluster.kubectl("-n", ns, "annotate", "pdd", NAME, f"test.pdfleet.io/apply={self.sent}",
                                       "--overwrite", check=False)
            if out.returncode != 0:
                self.refused.append(f"{ns}: {out.stderr.strip()[:300]}")

    def stop(self) -> None:
        self._stop.set()
        self._t.join(30)


@pytest.fixture
def release(cluster: LocalCluster, crd: str, tmp_path: Path) -> Iterator[tuple[Release, Front, list[str], list[str]]]:
    suffix = uuid.uuid4().hex[:6]
    front = Front(free_port())
    rel = Release(cluster, f"up-sys-{suffix}", f"up-a-{suffix}", front.port, tmp_path)
    namespaces = [rel.apps, f"up-b-{suffix}"]
    _namespace(cluster, rel.system)
    for ns in namespaces:
        _namespace(cluster, ns)
    values = ["--set", f"watch.namespaces={{{','.join(namespaces)}}}",
              "--set", f"webhook.url=https://127.0.0.1:{front.port}"]
    try:
        rel.helm("install", RELEASE, str(CHART), "-n", rel.system, "--take-ownership", *values)
        yield rel, front, values, namespaces
    finally:
        front.close()
        rel.helm("uninstall", RELEASE, "-n", rel.system, "--wait", check=False)
        for ns in (*namespaces, rel.system):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _pods(fleet: Fleet) -> dict[str, tuple[str, int]]:
    """Every runtime and router pod: name -> (uid, restarts)."""
    return {p.metadata.name: (p.metadata.uid, sum(s.restart_count for s in p.status.container_statuses or ()))
            for p in fleet.core.list_namespaced_pod(fleet.ns).items if not p.metadata.deletion_timestamp}


def test_helm_upgrade_with_two_fleets_serving_drops_and_denies_nothing(
        cluster: LocalCluster, release: tuple[Release, Front, list[str], list[str]], tmp_path: Path) -> None:
    rel, front, values, namespaces = release
    with contextlib.ExitStack() as stack:
        old = [Replica(rel, f"old-{i}", namespaces, resync=3) for i in range(2)]
        for r in old:
            stack.callback(r.stop)
        front.backends = [r.port for r in old]
        fleets = [stack.enter_context(running_fleet(cluster, ns, tmp_path / f"pods-{i}"))
                  for i, ns in enumerate(namespaces)]
        before = [_pods(f) for f in fleets]
        secret = rel.get(rel.system, "secret", f"{rel.sa}-webhook-tls")["data"]
        stored = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)["status"]["storedVersions"]
        traffic = [f.traffic() for f in fleets]
        for t in traffic:
            t.wait_served(4)
        applier = Applier(cluster, namespaces)
        stack.callback(applier.stop)  # also when an assertion fails first: no apply after the test
        t0 = time.monotonic()

        # The chart's documented upgrade: the CRD first (Helm never upgrades crds/), then the release.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
        rel.helm("upgrade", RELEASE, str(CHART), "-n", rel.system, *values, "--set", "operator.resyncSeconds=7")
        args = rel.get(rel.system, "deployment", rel.sa)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--resync-seconds=7" in args
        # The Deployment's rolling update, maxSurge 1 and maxUnavailable 0: a new replica up before an old goes.
        new: list[Replica] = []
        for i, replica in enumerate(old):
            new.append(Replica(rel, f"new-{i}", namespaces, resync=7))
            stack.callback(new[-1].stop)
            front.backends = [r.port for r in (*old[i:], *new)]
            time.sleep(2)
            front.backends = [r.port for r in (*old[i + 1:], *new)]  # out of the endpoints, then stopped
            time.sleep(1)
            replica.stop()
        time.sleep(15)  # traffic and applies on the new replicas alone
        applier.stop()
        for t in traffic:
            t.stop()
        took = time.monotonic() - t0
        counts = [t.assert_clean() for t in traffic]
        print(f"helm upgrade: {took:.0f} s; applies {applier.sent}, refused {len(applier.refused)}; requests per "
              f"fleet {[t.served() for t in traffic]}, client failures {[c.client_failures for c in counts]}, router "
              f"retries {[c.router_retries for c in counts]}", flush=True)
        assert not applier.refused, applier.refused[:5]
        assert applier.sent >= 20
        assert rel.get(rel.system, "secret", f"{rel.sa}-webhook-tls")["data"] == secret
        assert json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)["status"][
            "storedVersions"] == stored
        for fleet, pods in zip(fleets, before, strict=True):
            assert fleet.available()
            assert _pods(fleet) == pods, "the upgrade rendered the same pods: none replaced or restarted"
        # The new replicas reconcile: one of them resumed (kopf peering), and it writes status.
        logs = "".join(r.log.read_text(errors="replace") for r in new)
        assert "Resuming operations" in logs, logs[-3000:]
