"""A real local control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok with fake GPU nodes, inside the cluster's private network
namespace (``sandbox``): the components talk over its loopback, the apiserver also
listens on the bridge and advertises the bridge address, so ``kubernetes.default``
has a valid endpoint that pods reach.

This is what controller-runtime's envtest does, plus the controllers and the
scheduler so that Deployments and StatefulSets really roll and garbage
collection really runs.  All state (certificates, kubeconfig, etcd data,
logs, the pid file) lives in one directory, so `pdfleet dev down` from
another process can stop exactly what `pdfleet dev up` started.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pdfleet_devcluster import node, procs, sandbox, toolchain
from pdfleet_operator.certs import CertificateAuthority, write_service_account_key

__all__ = ["RACK_LABEL", "ClusterError", "ClusterOptions", "LocalCluster", "StopReport", "gpu_node_manifest"]

PID_FILE = "pids.json"
KUBECONFIG = "kubeconfig.yaml"
# Order matters: stop in reverse, so kwok and controllers go before the apiserver and etcd.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "coredns", "kube-proxy")


RACK_LABEL = "topology.example.com/rack"


class ClusterError(RuntimeError):
    """The control plane could not start; the message names the component and its log."""


@dataclass(frozen=True)
class ClusterOptions:
    """How big the fake fleet is.  Defaults match one 8-GPU H200 host per node."""

    nodes: int = 3
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H200"
    gpu_memory_mib: int = 143771
    node_prefix: str = "kwok-gpu"
    # Nodes per rack (label RACK_LABEL: rack-<i // nodes_per_rack>), for topology packing (spec.scheduling);
    # the default 3 nodes make racks of 2 and 1, so a 2-node group fits one rack only.
    nodes_per_rack: int = 2
    start_timeout_s: float = 180.0
    sandbox_index: int = 0  # which pod and Service ranges (sandbox.Ranges): distinct per parallel cluster

    @property
    def ranges(self) -> sandbox.Ranges:
        return sandbox.Ranges(self.sandbox_index)


@dataclass(frozen=True)
class StopReport:
    """What ``LocalCluster.stop`` stopped: the control plane's pids, the other processes it found in the
    cluster's namespaces, and what it could not stop (empty: nothing of the cluster is left)."""

    control_plane: list[int]
    others: list[procs.Proc]
    left: list[procs.Proc]

    def __str__(self) -> str:
        text = f"stopped {len(self.control_plane)} control-plane processes"
        if self.others:
            text += f" and {len(self.others)} more left in the cluster's namespaces"
        if self.left:
            return text + "; COULD NOT STOP: " + "; ".join(str(p) for p in self.left)
        return text + "; nothing of the cluster is left running"


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) is one any process's next outgoing connection may take before the caller binds it (seen: an operator's
    webhook port taken that way under CI's load, "address already in use"). Random, so concurrent tests rarely
    draw the same; the kernel's choice only when nothing below is free."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port the kernel hands out for outgoing connections (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def gpu_node_manifest(name: str, opts: ClusterOptions, index: int = 0) -> dict:
    """A Node object that kwok will manage, with allocatable `nvidia.com/gpu`; node ``index`` is in rack
    ``index // nodes_per_rack``."""
    resources_ = {
        "cpu": "128",
        "memory": "2Ti",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(opts.gpus_per_node),
        # What k8s-rdma-shared-dev-plugin advertises: pods on protocol rdma request one.
        "rdma/rdma_shared_device_a": "1k",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.product": opts.gpu_product,
                "nvidia.com/gpu.count": str(opts.gpus_per_node),
                "nvidia.com/gpu.memory": str(opts.gpu_memory_mib),
                **({RACK_LABEL: f"rack-{index // opts.nodes_per_rack}"} if opts.nodes_per_rack > 0 else {}),
            },
        },
        "spec": {},
        "status": {"allocatable": resources_, "capacity": resources_},
    }


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the child if the (test) process that owns it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class LocalCluster:
    """Start, wait for and stop one local control plane rooted at ``state_dir``."""

    state_dir: Path
    options: ClusterOptions = field(default_factory=ClusterOptions)
    # Fixtures set this so an aborted test run cannot leave processes behind;
    # `pdfleet dev up` leaves it False because the cluster outlives the command.
    die_with_parent: bool = False
    progress: Callable[[str], None] = lambda msg: print(f"[dev] {msg}", file=sys.stderr, flush=True)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, init=False, repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / KUBECONFIG

    @property
    def bin_dir(self) -> Path:
        return toolchain.toolchain_dir() / "bin"

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        """Build what is missing, start every component, wait until nodes are Ready."""
        if self.is_running():
            raise ClusterError(f"a cluster is already running from {self.state_dir}; run `pdfleet dev down`")
        started = time.monotonic()
        toolchain.ensure_toolchain()  # before entering: the builds need the module proxy
        sandbox.enter(self.options.ranges)
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        (self.state_dir / "logs").mkdir(parents=True)
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        self.progress(f"cluster ready in {time.monotonic() - started:.1f}s; kubeconfig: {self.kubeconfig}")

    def _start_all(self) -> None:
        d = self.state_dir
        net = self.options.ranges
        pki = d / "pki"
        ca = CertificateAuthority(pki)
        admin = ca.issue(
            "admin",
            common_name="admin",
            organizations=("system:masters",),
            ips=("127.0.0.1", net.gateway, net.kubernetes_service_ip),
            dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            server=True,
            client=True,
        )
        sa_key, sa_pub = write_service_account_key(pki)
        ports = {name: free_port() for name in ("etcd", "etcd-peer", "apiserver", "kcm", "sched", "kwok",
                                                "dns-health", "dns-ready", "proxy-metrics", "proxy-healthz")}
        api = f"https://127.0.0.1:{ports['apiserver']}"
        self._write_kubeconfig(api, ca.cert_pem, admin.cert_pem, admin.key_pem)
        kc = str(self.kubeconfig)

        self.progress(f"starting etcd on 127.0.0.1:{ports['etcd']}")
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._spawn("etcd", [
            "--name=pdfleet", f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=pdfleet={peer_url}", "--unsafe-no-fsync=true", "--log-level=warn",
        ])
        self._wait_http("etcd", f"{etcd_url}/health", insecure=False)

        self.progress(f"starting kube-apiserver on {api}")
        self._spawn("kube-apiserver", [
            f"--etcd-servers={etcd_url}",
            # Every address of the private namespace: its loopback and the bridge the pods are on.
            "--bind-address=0.0.0.0", f"--advertise-address={net.gateway}",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={admin.cert_path}", f"--tls-private-key-file={admin.key_path}",
            f"--client-ca-file={ca.cert_path}",
            f"--service-account-issuer={api}",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={net.service_cidr}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={pki / 'apiserver'}",
            "--v=1",
        ])
        self._wait_http("kube-apiserver", f"{api}/readyz", insecure=True, timeout=self.options.start_timeout_s)

        self.progress("starting kube-controller-manager and kube-scheduler")
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={ports['kcm']}",
            f"--service-account-private-key-file={sa_key}", f"--root-ca-file={ca.cert_path}",
            "--use-service-account-credentials=false",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
            "--concurrent-gc-syncs=5", "--profiling=false", "--v=1",
        ])
        self._spawn("kube-scheduler", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={ports['sched']}",
            "--profiling=false", "--v=1",
        ])
        self._wait_http("kube-controller-manager", f"https://127.0.0.1:{ports['kcm']}/healthz", insecure=True)
        self._wait_http("kube-scheduler", f"https://127.0.0.1:{ports['sched']}/healthz", insecure=True)

        stages = d / "kwok.yaml"
        stages.write_text(resources.files("pdfleet_devcluster").joinpath("kwok-stages.yaml").read_text())
        self.progress(f"starting kwok with {self.options.nodes} fake GPU nodes")
        self._spawn("kwok", [
            f"--kubeconfig={kc}", f"--config={stages}",
            "--manage-all-nodes=true", f"--cidr={net.gateway}/{net.prefix}", f"--node-ip={net.gateway}",
            f"--server-address=127.0.0.1:{ports['kwok']}",
            "--node-lease-duration-seconds=40",
        ])
        nodes = [gpu_node_manifest(f"{self.options.node_prefix}-{i}", self.options, i)
                 for i in range(self.options.nodes)]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(nodes))
        self._wait_for(
            "nodes Ready",
            lambda: self._count_ready_nodes() >= self.options.nodes,
        )
        self._wait_for(
            "default ServiceAccount",
            lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
        )
        self._start_node_services(ports, nodes[0]["metadata"]["name"])

    def _start_node_services(self, ports: dict[str, int], node_name: str) -> None:
        """CoreDNS and kube-proxy (nftables), as the node runs them (see ``node``)."""
        net = self.options.ranges
        self.progress("starting CoreDNS and kube-proxy (nftables)")
        conf = self.state_dir / "Corefile"
        conf.write_text(node.corefile(self.kubeconfig, ports["dns-health"], ports["dns-ready"]))
        self._spawn("coredns", node.coredns_args(conf))
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(node.kube_dns_objects(net)))
        self._spawn("kube-proxy", node.kube_proxy_args(self.kubeconfig, net, node_name, ports["proxy-metrics"],
                                                       ports["proxy-healthz"]))
        self._wait_http("coredns", f"http://127.0.0.1:{ports['dns-ready']}/ready", insecure=False,
                        timeout=self.options.start_timeout_s)  # it waits for the apiserver: slow on a loaded host
        self._wait_http("kube-proxy", f"http://127.0.0.1:{ports['proxy-healthz']}/healthz", insecure=False)

    def stop(self, timeout: float = 15.0) -> StopReport:
        """Stop everything the cluster runs: first every other process in its namespaces (``sweep``: pods'
        processes, routers, kubelets, operators a run left behind), then every recorded component (TERM,
        then KILL). What could not be stopped is said through ``progress`` and listed in the report."""
        others, left = self.sweep()
        pids = self._recorded_pids()
        stopped = []
        # The apiserver before etcd, as a control plane is taken down: its shutdown writes to etcd (its lease,
        # its endpoints), and with etcd gone first it retries until it is killed (seen: 15 s per stop).
        for tier in ([n for n in reversed(COMPONENTS) if n != "etcd"], ["etcd"]):
            termed = []
            for name in tier:
                pid = pids.get(name)
                if pid is None or not _alive(pid):
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
                termed.append(pid)
            deadline = time.monotonic() + timeout
            for pid in termed:
                while _alive(pid) and time.monotonic() < deadline:
                    self._reap(pid)
                    time.sleep(0.05)
                if _alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                self._reap(pid)
            stopped += termed
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        self._procs.clear()
        # Orphans of an earlier `dev up` are reaped by init: wait until they are out of the process
        # table too, so `pgrep` right after `dev down` shows nothing.
        gone_by = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in stopped) and time.monotonic() < gone_by:
            time.sleep(0.05)
        for pid in stopped:
            if _alive(pid):
                left.append(procs.Proc(pid, 0, 0, f"{next(n for n, p in pids.items() if p == pid)} (control plane)"))
                self.progress(f"could not stop the control plane's pid {pid}")
        pid_file = self.state_dir / PID_FILE
        if pid_file.exists() and not left:
            pid_file.unlink()
        return StopReport(stopped, others, left)

    def sweep(self, timeout: float = 10.0) -> tuple[list[procs.Proc], list[procs.Proc]]:
        """Stop every process in the cluster's network namespace and its pods' (less this process, its
        ancestors and the control plane): a kubelet's pods, routers, rank processes re-parented to PID 1,
        an operator. Returns (stopped, could not be stopped); both are said through ``progress``.

        The namespaces are read from a live component (its ``ns/net`` and its mount namespace's
        ``/run/netns``): once the control plane is gone nothing names them reliably any more."""
        pids = self._recorded_pids()
        holder = next((pid for pid in pids.values() if _alive(pid)), None)
        if holder is None:
            return [], []
        inodes = set(procs.pod_namespaces(holder).values())
        cluster_ns = procs.net_ns(holder)
        if cluster_ns is not None:
            inodes.add(cluster_ns)
        found = procs.in_namespaces(inodes, exclude=procs.ancestors() | set(pids.values()))
        if not found:
            return [], []
        self.progress(f"stopping {len(found)} processes left in the cluster's namespaces (pods, routers, clients): "
                      + "; ".join(str(p) for p in found[:8]) + (" ..." if len(found) > 8 else ""))
        stopped, left = procs.stop(found, timeout)
        for p in left:
            self.progress(f"could not stop {p}")
        return stopped, left

    def namespace_pid(self) -> int | None:
        """A live process of the cluster (the apiserver): its namespaces are the cluster's."""
        pid = self._recorded_pids().get("kube-apiserver")
        return pid if pid is not None and _alive(pid) else None

    def is_running(self) -> bool:
        return any(_alive(pid) for pid in self._recorded_pids().values())

    # ---- clients ---------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster; raise with stderr when ``check``."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Poll until the CRD is Established (``kubectl wait`` errors out while status is still empty)."""

        def established() -> bool:
            out = self.kubectl("get", "crd", crd, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            conds = json.loads(out.stdout).get("status", {}).get("conditions") or ()
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)

        self._wait_for(f"CRD {crd} Established", established, timeout)

    def install_crd(self, timeout: float = 60.0) -> str:
        """Apply the PDDeployment CRD generated from the API models and wait until it is served
        (Established, and listed by discovery); returns its name. Also installs the runtime pod-status
        policy, which the chart installs with the CRD (``devcluster.policies``)."""
        from pdfleet_devcluster.policies import runtime_policy_yaml
        from pdfleet_operator.api.crd import CRD_NAME, crd_yaml, rolescale_crd_yaml

        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd_yaml())
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rolescale_crd_yaml())
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=runtime_policy_yaml())
        self.wait_established(CRD_NAME, timeout)
        self._wait_for("pdd discovery", lambda: self.kubectl("get", "pdd", "-A", check=False).returncode == 0, timeout)
        return CRD_NAME

    def kubelet(self, namespace: str, workdir: Path, **kw: Any) -> Any:  # -> kubelet.Kubelet (lazy: kubernetes)
        """The harness's kubelet for ``namespace``'s pods, not started (``start()``, ``shutdown()``)."""
        from pdfleet_devcluster.kubelet import Kubelet

        endpoint = (self.options.ranges.kubernetes_service_ip, 443)  # through kube-proxy, as in a cluster
        return Kubelet(self.api_client(), namespace, workdir, self.options.ranges, endpoint, **kw)

    def api_client(self):  # -> kubernetes.client.ApiClient (imported lazily: slow import)
        from pdfleet_runtime.kubeapi import api_client

        return api_client(self.kubeconfig)

    # ---- internals -------------------------------------------------------
    def _spawn(self, name: str, args: Sequence[str]) -> None:
        exe = self.bin_dir / name
        log = (self.state_dir / "logs" / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [str(exe), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
            cwd=self.state_dir,
        )
        log.close()
        self._procs[name] = proc
        pids = self._recorded_pids()
        pids[name] = proc.pid
        tmp = self.state_dir / f".{PID_FILE}.tmp"  # replaced whole: a reader never sees half of it
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, self.state_dir / PID_FILE)

    def _recorded_pids(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads((self.state_dir / PID_FILE).read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def _reap(self, pid: int) -> None:
        for proc in self._procs.values():
            if proc.pid == pid:
                proc.poll()
                return
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)

    def _check_alive(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            log = self.state_dir / "logs" / f"{name}.log"
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise ClusterError(f"{name} exited with {proc.returncode}; last lines of {log}:\n{tail}")

    def _wait_http(self, name: str, url: str, insecure: bool, timeout: float = 60.0) -> None:
        ctx: ssl.SSLContext | None = None
        if url.startswith("https"):
            ctx = ssl.create_default_context()
            if insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            ctx.load_cert_chain(self.state_dir / "pki" / "admin.crt", self.state_dir / "pki" / "admin.key")

        def ok() -> bool:
            self._check_alive(name)
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        self._wait_for(f"{name} healthy", ok, timeout)

    def _wait_for(self, what: str, cond: Callable[[], bool], timeout: float | None = None) -> None:
        timeout = timeout or self.options.start_timeout_s
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            for name in self._procs:
                self._check_alive(name)
            if cond():
                self.progress(f"  {what} ({time.monotonic() - start:.1f}s)")
                return
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.state_dir / 'logs'}")

    def _count_ready_nodes(self) -> int:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return 0
        ready = 0
        for item in json.loads(out.stdout)["items"]:
            for cond in item.get("status", {}).get("conditions", []):
                if cond["type"] == "Ready" and cond["status"] == "True":
                    ready += 1
        return ready

    def _write_kubeconfig(self, server: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> None:
        import base64

        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode()

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "pdfleet-dev", "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}],
            "users": [{"name": "admin", "user": {"client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem)}}],
            "contexts": [{"name": "pdfleet-dev", "context": {"cluster": "pdfleet-dev", "user": "admin"}}],
            "current-context": "pdfleet-dev",
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg))
        self.kubeconfig.chmod(0o600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
