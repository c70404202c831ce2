"""One pod as the harness's container runtime gives it: a network namespace, volumes, processes.

- the network: a network namespace (``ip netns add``) with the pod's IP from kwok on a veth joined to
  the cluster bridge, its own loopback, a default route via the bridge, and /etc/resolv.conf and
  /etc/hosts of its own (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/*``);
- the volumes, written under the pod's directory and bind-mounted at their mountPaths in each
  container's own mount namespace: ConfigMaps, Secrets, emptyDirs (``medium: Memory`` a tmpfs),
  projected volumes (a ServiceAccount token minted for this pod through the TokenRequest API, bound
  to the pod; ConfigMap keys such as ``kube-root-ca.crt``; the downward API), and hostPath volumes
  (a host directory or file bound as it is: how a model directory reaches the reference engine's pods,
  ``pdfleet demo``);
- each container's command (``$(VAR)`` expanded from its env) in its own process group, and its
  termination as the kubelet does it: the preStop hook (``exec`` inside the container's namespaces,
  ``httpGet`` to the pod IP), then SIGTERM, then SIGKILL when the grace period is over.

What it does not do, being a harness: pull images (the host's filesystem is every image), apply
securityContext users and capabilities (containers run as the harness's user), restart containers,
run probes (kwok's stages set readiness), rotate tokens (one hour is longer than any run).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdfleet_devcluster import podspec
from pdfleet_devcluster.image import Image
from pdfleet_devcluster.podspec import Exec, HttpGet, PodSpecError, Sleep
from pdfleet_devcluster.sandbox import BRIDGE, Ranges

__all__ = ["Container", "PodSandbox", "TokenMinter", "VolumeSource", "host_path"]

TokenMinter = Callable[[dict, str, int, str], str]
"""(pod, service account, expiration seconds, audience or "") -> a token bound to the pod."""
Lookup = Callable[[str, str], "dict[str, bytes] | None"]
"""(kind configMap|secret, name) -> its keys and values (decoded), or None when it does not exist."""
IPS_IN_USE: set[str] = set()
"""Pod IPs whose network namespace exists in this process's cluster, whichever kubelet made it: a pod
of an earlier test's kubelet may still be stopping when kwok hands its IP to the next pod."""
MIN_TERM_GRACE_S = 2.0
"""The kubelet's minimumGracePeriodInSeconds: SIGTERM gets at least this long before SIGKILL, even when the
preStop hooks used up the grace period (a host stalled under load can make a quick hook look slow)."""
STRAGGLER_WAIT_S = 10.0
"""How long the pod's network teardown keeps killing what is left in its namespace before it gives up
(a process in uninterruptible sleep) and keeps the namespace's name, so a later sweep finds it."""
STAGING = "/etc/netns/.volumes"
"""Where a container's mount namespace first binds its pod's volume directory: on the cluster
namespace's own tmpfs (``sandbox.enter``), which no volume mount of a pod covers."""


HOST_PATH_TYPES = {"": None, "Directory": Path.is_dir, "File": Path.is_file, "DirectoryOrCreate": None}
"""hostPath types the harness binds, and the check each must pass on the host before the pod starts."""


@dataclass(frozen=True)
class VolumeSource:
    """Where a volume's content is on the host: ``path`` under the pod's work directory (``host`` False), a host
    path of its own (``host`` True: hostPath), or ``None`` for a tmpfs; ``read_only`` for keys the kubelet wrote."""

    path: Path | None
    read_only: bool
    host: bool = False


def host_path(pod: str, volume: str, src: dict) -> Path:
    """The host path a hostPath volume binds, checked as its ``type`` says, as the kubelet does before the pod
    starts (a missing model directory fails the pod, not the engine inside it); ``PodSpecError`` names it."""
    path, kind = Path(str(src.get("path") or "")), str(src.get("type") or "")
    if not path.is_absolute():
        raise PodSpecError(f"pod {pod}: hostPath volume {volume!r} needs an absolute path, not {str(path)!r}")
    if kind not in HOST_PATH_TYPES:
        raise PodSpecError(f"pod {pod}: hostPath volume {volume!r} of type {kind!r} is not supported by the "
                           f"harness's kubelet (it binds {sorted(t for t in HOST_PATH_TYPES if t)} or no type)")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    check = HOST_PATH_TYPES[kind]
    if not path.exists() or (check is not None and not check(path)):
        what = {"Directory": "an existing directory", "File": "an existing file"}.get(kind, "an existing path")
        raise PodSpecError(f"pod {pod}: hostPath volume {volume!r}: {path} is not {what} on the host")
    return path


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


@dataclass(eq=False)
class Container:
    """One started container: its process (the group leader) and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    spec: dict


@dataclass(eq=False)
class PodSandbox:
    """The pod ``pod`` (its dict, as the API serves it) on this node, rooted at ``workdir``."""

    pod: dict
    workdir: Path
    ranges: Ranges
    api_endpoint: tuple[str, int]  # what KUBERNETES_SERVICE_HOST/PORT say
    lookup: Lookup
    mint: TokenMinter
    base_env: Mapping[str, str] = field(default_factory=dict)  # the "image's" environment (PATH, PYTHONPATH)
    extra_args: tuple[str, ...] = ()
    rewrite: Callable[[PodSandbox, dict], dict] | None = None
    """A stand-in image: (this sandbox, a container) -> the container to run (``standin.SGLangStandIn``)."""
    image_paths: tuple[Path, ...] = ()
    """The directories the image runs from (``image.Image.paths``): those a volume mount hides are bound
    back at their own paths, read-only, after the container's mounts."""
    containers: list[Container] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    """What the kubelet did, in order (hooks, signals), each stamped with the seconds since the sandbox was made,
    so a stalled host is told apart from a hook or a signal that never ended."""

    def __post_init__(self) -> None:
        meta = self.pod["metadata"]
        self.name, self.namespace, self.uid = meta["name"], meta["namespace"], meta["uid"]
        self.ip = self.pod["status"]["podIP"]
        self.netns = f"pod-{self.uid[:13]}"
        self._veth = f"v{self.uid[:8]}"
        self._terminated = threading.Event()
        self.network_up = False  # its netns exists: its IP is taken on the bridge
        self.left: list[int] = []  # pids still in its netns after termination (none: nothing left running)
        self.made_at = time.monotonic()  # the clock its events count from (the host's monotonic clock)

    def _event(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.made_at:.1f}s {what}")

    # ---- what callers read -------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Every container has been started (``start`` runs on the kubelet's thread)."""
        return len(self.containers) == len(self.pod["spec"]["containers"])

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.containers[0].proc if self.containers else None

    @property
    def log_path(self) -> Path:
        first = self.pod["spec"]["containers"][0]["name"]
        return self.workdir / f"{first}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def port(self, name: str) -> int:
        for c in self.pod["spec"]["containers"]:
            with contextlib.suppress(PodSpecError):
                return podspec.port_number(c, name)
        raise PodSpecError(f"pod {self.name} has no port named {name!r}")

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port('http')}"

    @property
    def bootstrap(self) -> str:
        return f"{self.ip}:{self.port('bootstrap')}"

    def exec(self, *cmd: str, container: int = 0, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``kubectl exec``: ``cmd`` in the container's mount and network namespaces, with its env."""
        c = self.containers[container]
        return subprocess.run(["nsenter", "--target", str(c.proc.pid), "--mount", "--net", "--", *cmd],
                              env=c.env, capture_output=True, text=True, timeout=timeout_s)

    def signal(self, sig: signal.Signals) -> None:
        for c in self.containers:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(sig)

    # ---- start ------------------------------------------------------------------------------
    def start(self) -> PodSandbox:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._network()
        volumes = self._volumes()
        for spec in self.pod["spec"]["containers"]:
            self.containers.append(self._start_container(self.rewrite(self, spec) if self.rewrite else spec, volumes))
        return self

    def _network(self) -> None:
        _ip("netns", "add", self.netns)
        self.network_up = True
        IPS_IN_USE.add(self.ip)
        _ip("link", "add", self._veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("link", "set", self._veth, "master", BRIDGE, "up")
        _ip("-n", self.netns, "addr", "add", f"{self.ip}/{self.ranges.prefix}", "dev", "eth0")
        # kwok hands a freed IP to the next pod at once: the node and the other pods still map it to the
        # old pod's MAC, so the new pod announces itself (a gratuitous ARP when eth0 comes up), which
        # updates their entries instead of waiting out the stale ones (a minute of unreachable pod).
        _ip("netns", "exec", self.netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/conf/eth0/arp_notify")
        _ip("neigh", "flush", "to", self.ip, "dev", BRIDGE)
        _ip("-n", self.netns, "link", "set", "eth0", "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "route", "add", "default", "via", self.ranges.gateway)
        etc = Path("/etc/netns") / self.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(podspec.resolv_conf(self.namespace, self.ranges.dns_service_ip))
        (etc / "hosts").write_text(podspec.hosts(self.pod))

    def _volumes(self) -> dict[str, VolumeSource]:
        """Volume name -> where its content is."""
        out: dict[str, VolumeSource] = {}
        for vol in self.pod["spec"].get("volumes") or ():
            name, d = vol["name"], self.workdir / "volumes" / vol["name"]
            if "hostPath" in vol:
                out[name] = VolumeSource(host_path(self.name, name, vol["hostPath"] or {}), False, host=True)
                continue
            d.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in vol:
                out[name] = VolumeSource(None if (vol["emptyDir"] or {}).get("medium") == "Memory" else d, False)
            elif "configMap" in vol or "secret" in vol:
                self._write_keys(d, vol)
                out[name] = VolumeSource(d, True)
            elif "projected" in vol:
                mode = vol["projected"].get("defaultMode", 0o644)
                for src in vol["projected"].get("sources") or ():
                    self._write_projection(d, src, mode)
                out[name] = VolumeSource(d, True)
            else:
                raise PodSpecError(f"pod {self.name}: volume {name!r} of kind {sorted(set(vol) - {'name'})} "
                                   "is not supported by the harness's kubelet")
        return out

    def _write_keys(self, d: Path, vol: dict) -> None:
        kind = "configMap" if "configMap" in vol else "secret"
        src = vol[kind]
        ref = src.get("name") if kind == "configMap" else src.get("secretName")
        self._project(d, kind, ref, src.get("items"), src.get("defaultMode", 0o644), bool(src.get("optional")))

    def _project(self, d: Path, kind: str, ref: str, items: list | None, mode: int, optional: bool) -> None:
        data = self.lookup(kind, ref)
        if data is None:
            if optional:
                return
            raise PodSpecError(f"pod {self.name}: {kind} {ref!r} not found")
        for item in items or [{"key": k, "path": k} for k in data]:
            if item["key"] not in data:
                if optional:
                    continue
                raise PodSpecError(f"pod {self.name}: {kind} {ref!r} has no key {item['key']!r}")
            _write(d / item["path"], data[item["key"]], item.get("mode", mode))

    def _write_projection(self, d: Path, src: dict, mode: int) -> None:
        if "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            sa = self.pod["spec"].get("serviceAccountName") or "default"
            token = self.mint(self.pod, sa, int(t.get("expirationSeconds") or 3600), t.get("audience") or "")
            _write(d / t["path"], token, mode)
        elif "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            s = src[kind]
            self._project(d, kind, s["name"], s.get("items"), mode, bool(s.get("optional")))
        elif "downwardAPI" in src:
            for item in src["downwardAPI"].get("items") or ():
                if "fieldRef" not in item:
                    raise PodSpecError(f"pod {self.name}: downwardAPI item {item['path']!r} needs a fieldRef")
                _write(d / item["path"], podspec.field_value(self.pod, item["fieldRef"]["fieldPath"]), mode)
        else:
            raise PodSpecError(f"pod {self.name}: projected source {sorted(src)} is not supported")

    def _kubelet_env(self) -> dict[str, str]:
        host, port = self.api_endpoint
        return {**self.base_env, "HOSTNAME": self.pod["spec"].get("hostname") or self.name,
                "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
                "KUBERNETES_SERVICE_PORT_HTTPS": str(port), "KUBERNETES_PORT": f"tcp://{host}:{port}",
                f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}"}

    def _start_container(self, spec: dict, volumes: dict[str, VolumeSource]) -> Container:
        def key(kind: str, name: str, k: str) -> str | None:
            value = (self.lookup(kind, name) or {}).get(k)
            return None if value is None else value.decode()

        env = podspec.container_env(self.pod, spec, key, self._kubelet_env())
        argv = [podspec.expand(a, env) for a in [*(spec.get("command") or ()), *(spec.get("args") or ())]]
        if not argv:
            raise PodSpecError(f"pod {self.name}: container {spec['name']!r} has no command (no image to take it from)")
        argv += self.extra_args
        # The volumes' sources live under the pod's work directory (often under /tmp), which a mount
        # such as an emptyDir at /tmp would hide from the mounts after it: bind that directory first at
        # a staging point on the cluster namespace's own tmpfs, and mount parents before children
        # (containerd sorts mounts by depth the same way).
        root = self.workdir / "volumes"
        stage = f"{STAGING}/{shlex.quote(self.name)}.{shlex.quote(spec['name'])}"
        script = ["set -e", f"mkdir -p {stage}", f"mount --bind {shlex.quote(str(root))} {stage}"]
        mounts = sorted(spec.get("volumeMounts") or (), key=lambda m: len(Path(m["mountPath"]).parts))
        # The image's directories a mount hides (a checkout or a venv under /tmp, where every runtime pod
        # mounts an emptyDir): staged beside the volumes before any mount, bound back read-only after them.
        hidden = Image({}, self.image_paths).hidden_by(m["mountPath"] for m in mounts)
        for i, path in enumerate(hidden):
            script += [f"mkdir -p {stage}.image/{i}", f"mount --bind {shlex.quote(str(path))} {stage}.image/{i}"]
        # A hostPath source may be hidden by an earlier mount too (a model under /tmp): staged the same way.
        for m in mounts:
            v = volumes[m["name"]]
            if v.host and v.path is not None:
                at = f"{stage}.host/{shlex.quote(m['name'])}"
                script += [f"mkdir -p {at}" if v.path.is_dir() else f"mkdir -p {stage}.host && touch {at}",
                           f"mount --bind {shlex.quote(str(v.path))} {at}"]
        for m in mounts:
            if m.get("subPath"):
                raise PodSpecError(f"pod {self.name}: volumeMount {m['name']!r} uses subPath (not supported)")
            v = volumes[m["name"]]
            dst = shlex.quote(m["mountPath"])
            if v.path is not None and v.host and not v.path.is_dir():
                script.append(f"mkdir -p {shlex.quote(str(Path(m['mountPath']).parent))} && touch {dst}")
            else:
                script.append(f"mkdir -p {dst}")
            if v.path is None:
                script.append(f"mount -t tmpfs -o mode=1777 tmpfs {dst}")
            else:
                staged = (f"{stage}.host/{shlex.quote(m['name'])}" if v.host
                          else f"{stage}/{shlex.quote(str(v.path.relative_to(root)))}")
                script.append(f"mount --bind {staged} {dst}")
                if v.read_only or m.get("readOnly"):
                    script.append(f"mount -o remount,bind,ro {dst}")
        for i, path in enumerate(hidden):
            dst = shlex.quote(str(path))
            script += [f"mkdir -p {dst}", f"mount --bind {stage}.image/{i} {dst}", f"mount -o remount,bind,ro {dst}"]
        script.append(f"cd {shlex.quote(spec.get('workingDir') or '/')}")
        script.append('exec "$@"')
        log_path = self.workdir / f"{spec['name']}.log"
        log = log_path.open("ab")
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, "sh", "-c", "\n".join(script), "sh", *argv],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        log.close()
        self._event(f"started {spec['name']}")
        return Container(spec["name"], proc, log_path, env, spec)

    # ---- stop -------------------------------------------------------------------------------
    def terminate(self, grace_s: float) -> None:
        """preStop hooks, SIGTERM, the rest of the grace period, SIGKILL of every process; then the netns."""
        if self._terminated.is_set():
            return
        self._terminated.set()
        deadline = time.monotonic() + grace_s
        termed: set[str] = set()

        def stop(c: Container) -> None:  # each container on its own, as the kubelet kills them: its hook, its SIGTERM
            self._pre_stop(c, deadline)
            self._sigterm(c, termed)

        hooks = [threading.Thread(target=stop, args=(c,), daemon=True) for c in self.containers]
        for t in hooks:
            t.start()
        for t in hooks:
            t.join(max(0.0, deadline - time.monotonic()))
        if grace_s > 0:  # as the kubelet does: hooks that used up the grace period still leave SIGTERM its minimum
            deadline = max(deadline, time.monotonic() + MIN_TERM_GRACE_S)
        for c in self.containers:  # a hook still running at the deadline is not waited for
            self._sigterm(c, termed)
        for c in self.containers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            if c.proc.poll() is None:
                self._event(f"SIGKILL {c.name}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)  # the group: no process of the container outlives it
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(10)
        self._network_down()
        with contextlib.suppress(OSError):  # what the kubelet did, beside the pod's logs (kept with a run's basetemp)
            (self.workdir / "kubelet-events.log").write_text("\n".join(self.events) + "\n")

    def _network_down(self) -> None:
        """Free the pod's IP only once nothing on the bridge can answer for it.

        A network namespace outlives ``ip netns delete`` while anything holds it: a process that left the
        container's process group, or an orphaned TCP socket still in FIN_WAIT (up to a minute). Its eth0
        would keep answering ARP for the IP kwok hands to the next pod, and its kernel would reset that
        pod's connections (seen as pods whose peers got "connection refused" for tens of seconds). So the
        stragglers are killed and the veth pair is deleted (both ends at once, synchronously) before the
        namespace's name goes; the IP stays taken if the veth could not be deleted."""
        if not self.network_up:
            return
        deadline = time.monotonic() + STRAGGLER_WAIT_S
        while (pids := _netns_pids(self.netns)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    what = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
                    os.kill(pid, signal.SIGKILL)
                    self._event(f"SIGKILL straggler {pid}: {what.strip()}")
            time.sleep(0.1)
        if pids:  # its name stays, so ``LocalCluster.sweep`` finds them; the IP stays taken
            self.left = pids
            self._event(f"could not stop {pids} in {self.netns}: its name and IP {self.ip} stay")
            return
        with contextlib.suppress(RuntimeError):
            _ip("link", "delete", self._veth)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "delete", self.netns)
        if _link_exists(self._veth):
            self._event(f"veth {self._veth} still on the bridge: IP {self.ip} stays taken")
            return
        self.network_up = False
        IPS_IN_USE.discard(self.ip)

    def _sigterm(self, c: Container, termed: set[str]) -> None:
        if c.name in termed:
            return
        termed.add(c.name)
        if c.proc.poll() is None:
            self._event(f"SIGTERM {c.name}")
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)

    def _pre_stop(self, c: Container, deadline: float) -> None:
        h = podspec.hook(c.spec, "preStop")
        if h is None or c.proc.poll() is not None:
            return
        budget = max(1.0, deadline - time.monotonic())
        self._event(f"preStop {c.name} {type(h).__name__}")
        try:
            if isinstance(h, Sleep):
                time.sleep(min(h.seconds, budget))
            elif isinstance(h, Exec):
                subprocess.run(["nsenter", "--target", str(c.proc.pid), "--mount", "--net", "--", *h.command],
                               env=c.env, capture_output=True, timeout=budget)
            elif isinstance(h, HttpGet):
                url = f"{h.scheme.lower()}://{h.host or self.ip}:{h.port}{h.path}"
                with urllib.request.urlopen(url, timeout=budget) as resp:
                    resp.read()
        except Exception as exc:  # the kubelet logs a failed hook and goes on with SIGTERM
            self._event(f"preStop {c.name} failed: {exc!r}")
            return
        self._event(f"preStop {c.name} done")


def _netns_pids(netns: str) -> list[int]:
    """Processes still in the network namespace ``netns`` (none once it is gone)."""
    proc = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def _write(path: Path, value: str | bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(value.encode() if isinstance(value, str) else value)
    path.chmod(mode)

