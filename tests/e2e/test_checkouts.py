"""Two clones of different commits on one machine, both under /tmp (where every runtime pod mounts an
emptyDir, which hid a clone's code from its pods: issue 38), each set up one after the other (its own
layer over the shared venv, scripts/venvs.py) and each running its own kubelet (`pdfleet dev kubelet`
from its layer, started with this checkout's PATH on purpose): each clone's runtime pods run that clone's
code (the first line of their log names the clone and its commit), and each deployment answers a chat
request through its router's Service from those real runtime pods."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.commands.dev import chat_curl
from tests.cluster.conftest import OperatorProcess
from tests.helpers import delete_namespace_and_pods, wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
NAME = "chat"


def _shared_venv() -> Path:
    """The shared venv this run's layer is over (the clones' layers go over the same one)."""
    meta = Path(sys.prefix) / "checkout.json"
    assert meta.is_file(), (f"run the tests from a checkout's layer (`. scripts/setup.sh`, or scripts/test.sh): "
                            f"{sys.prefix} is not one")
    return Path(json.loads(meta.read_text())["deps"])


def _clone(dst: Path, message: str) -> str:
    """This tree (tracked and untracked files, as committed plus the working changes) in a clone of its own,
    committed on top of HEAD with ``message``: a commit of its own. Returns the commit."""
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(REPO), str(dst)], check=True,
                   timeout=120)
    subprocess.run(["bash", "-c", "git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t \"$0\"", str(dst)],
                   cwd=REPO, check=True, timeout=120)
    git = ["git", "-C", str(dst), "-c", "user.name=pdfleet tests", "-c", "user.email=tests@pdfleet.invalid"]
    subprocess.run([*git, "add", "-A"], check=True, timeout=60)
    subprocess.run([*git, "commit", "--quiet", "--allow-empty", "--no-verify", "-m", message], check=True, timeout=60)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def _layer(clone: Path, deps: Path) -> Path:
    out = subprocess.run([sys.executable, str(clone / "scripts" / "venvs.py"), "checkout", "--deps", str(deps)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def _manifest(ns: str) -> dict:
    role = {"replicas": 1, "parallelism": {"tensor": 1}, "image": "example.invalid/runtime:local",
            "pool": {"maxConcurrentRequests": 4, "kvTokensPerReplica": 2048}}
    return {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": NAME, "namespace": ns},
            "spec": {"model": {"layout": {"preset": "llama-dense"}}, "transfer": {"backend": "mooncake", "protocol": "tcp"},
                     "prefill": role, "decode": role, "router": {"image": "example.invalid/runtime:local"},
                     "rollout": {"drainTimeoutSeconds": 10}}}


@pytest.fixture
def clones() -> Iterator[Path]:
    """A directory under /tmp itself (not wherever pytest's basetemp is): the path pods mount over."""
    d = Path(tempfile.mkdtemp(prefix="pdfleet-clones-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _available(cluster: LocalCluster, ns: str) -> bool:
    out = cluster.kubectl("-n", ns, "get", "pdd", NAME, "-o", "json", check=False)
    conds = (json.loads(out.stdout).get("status") or {}).get("conditions") or () if out.returncode == 0 else ()
    return any(c["type"] == "Available" and c["status"] == "True" for c in conds)


def _chat(cluster: LocalCluster, ns: str) -> dict | None:
    _, out = chat_curl(cluster, ns, NAME, "Whose code answers?")
    try:
        answer = json.loads(out.stdout)
    except ValueError:
        return None
    return answer if answer.get("choices") else None


def _first_lines(workdir: Path) -> dict[str, str]:
    """Each runtime pod's first log line (the runtime writes which code it is first), by pod name."""
    out = {}
    for log in sorted(workdir.glob(f"{NAME}-*-*/*.log")):
        if "-router-" in log.parent.name or log.name == "kubelet-events.log":
            continue
        lines = log.read_text(errors="replace").splitlines()
        out[log.parent.name] = lines[0] if lines else ""
    return out


def _run_clone(cluster: LocalCluster, clone: Path, layer: Path, commit: str, ns: str, workdir: Path) -> None:
    # This checkout's PATH first, on purpose: the kubelet must give its pods its own interpreter's bin.
    kubelet = subprocess.Popen([str(layer / "bin" / "pdfleet"), "dev", "--state-dir", str(cluster.state_dir),
                                "kubelet", "-n", ns, "--arg=--device", "--arg=cpu", "--workdir", str(workdir)],
                               stdout=(workdir.parent / f"{ns}-kubelet.log").open("wb"), stderr=subprocess.STDOUT,
                               cwd=workdir.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(_manifest(ns)))
        try:
            wait_until(lambda: _available(cluster, ns), timeout=240, what=f"{ns}/{NAME} Available through its gates")
            answer = wait_until(lambda: _chat(cluster, ns), timeout=120, what="a chat answer through the router")
        except AssertionError as e:
            tails = {log.parent.name: log.read_text(errors="replace")[-1500:] for log in workdir.glob("*/*.log")}
            raise AssertionError(f"{e}\npods' logs: {json.dumps(tails, indent=1)}") from None
        assert answer["pdfleet"]["verified"] is True, answer  # real runtime pods moved and verified the bytes
        lines = _first_lines(workdir)
        assert {n.split("-")[1] for n in lines} == {"prefill", "decode"}, lines
        want = f"pdfleet-runtime 0.1.0 (checkout {clone} at {commit[:12]})"
        assert all(line == want for line in lines.values()), (want, lines)
    finally:
        delete_namespace_and_pods(cluster, ns)
        kubelet.send_signal(signal.SIGTERM)
        try:
            kubelet.wait(120)
        except subprocess.TimeoutExpired:
            kubelet.kill()
            kubelet.wait(10)
    assert kubelet.returncode == 0, (workdir.parent / f"{ns}-kubelet.log").read_text()[-3000:]


def test_two_clones_each_run_their_own_code_in_their_own_pods_from_under_tmp(
        cluster: LocalCluster, operator: OperatorProcess, clones: Path) -> None:
    deps = _shared_venv()
    a, b = clones / "clone-a", clones / "clone with space-b"
    commits = {a: _clone(a, "clone a"), b: _clone(b, "clone b")}
    assert commits[a] != commits[b]
    layers = {c: _layer(c, deps) for c in (a, b)}  # set up one after the other
    try:
        assert layers[a] != layers[b]
        for c in (a, b):
            version = subprocess.run([str(layers[c] / "bin" / "pdfleet-runtime"), "--version"], capture_output=True,
                                     text=True, timeout=60, cwd="/")
            assert version.stdout.strip() == f"pdfleet-runtime 0.1.0 (checkout {c} at {commits[c][:12]})", version
        for i, c in enumerate((a, b)):
            ns = f"clone-{i}-{int(time.time()) % 100000}"
            cluster.kubectl("create", "namespace", ns)
            wait_until(lambda ns=ns: cluster.kubectl("-n", ns, "get", "serviceaccount", "default",
                                                     check=False).returncode == 0, what=f"default ServiceAccount in {ns}")
            (clones / f"pods-{i}").mkdir()
            _run_clone(cluster, c, layers[c], commits[c], ns, clones / f"pods-{i}")
    finally:
        for layer in layers.values():  # keyed by this run's temporary paths: never used again
            shutil.rmtree(layer, ignore_errors=True)
