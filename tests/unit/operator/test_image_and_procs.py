"""What a local pod runs from (devcluster.image) and how a run's processes are found and stopped
(devcluster.procs):

- the image's PATH starts with the kubelet's own interpreter's bin directory, whatever PATH the caller
  had, so a pod's ``pdfleet-runtime`` is the checkout that started the kubelet;
- the directories a pod's mounts hide (under an emptyDir at /tmp) are bound back, outermost only, and a
  directory that holds a mount point (/tmp itself) never is;
- processes are found by their network namespace, a process re-parented to PID 1 included, and stopped
  (SIGTERM, then SIGKILL for one that ignores it); a pid is identified with its start time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pdfleet_devcluster import procs
from pdfleet_devcluster.image import Image, local_image
from pdfleet_runtime.source import checkout, commit, describe
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[3]


def test_the_image_path_starts_with_this_interpreter_and_binds_what_mounts_hide() -> None:
    image = local_image({"PATH": "/elsewhere/other-checkout/bin:/usr/bin", "HOME": "/root"})
    bindir = str(Path(sys.executable).parent)
    assert image.env["PATH"].split(os.pathsep)[:3] == [bindir, "/elsewhere/other-checkout/bin", "/usr/bin"]
    assert REPO in image.paths  # the checkout this code is from
    fake = Image({}, (Path("/tmp/a/clone"), Path("/tmp/a/clone/runtime"), Path("/tmp/cache/venv"), Path("/tmp"),
                      Path("/usr/lib/python3"), Path("/etc/pdfleet/x")))
    hidden = fake.hidden_by(["/tmp", "/dev/shm", "/etc/pdfleet"])
    assert set(hidden) == {Path("/etc/pdfleet/x"), Path("/tmp/a/clone"), Path("/tmp/cache/venv")}, hidden
    assert fake.hidden_by(["/var/run/secrets"]) == ()


def test_the_version_names_this_checkout_and_its_commit() -> None:
    assert checkout() == REPO
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head:  # a checkout in git (a source tarball has none)
        assert commit(REPO) == head
        assert describe("0.1.0") == f"0.1.0 (checkout {REPO} at {head[:12]})"


def test_processes_are_found_by_their_network_namespace_and_stopped(tmp_path: Path) -> None:
    # A process in a network namespace of its own that ignores SIGTERM, and a child of it re-parented to
    # PID 1 (its parent exited): both are found by the namespace and stopped.
    script = "trap '' TERM; (trap '' TERM; exec sleep 300) & echo $! > {out}; exec sleep 300".format(
        out=tmp_path / "child")
    holder = subprocess.Popen(["unshare", "--net", "sh", "-c", script], start_new_session=True)
    child = int(wait_until(lambda: (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip(),
                           what="the child's pid"))
    ns = procs.net_ns(holder.pid)
    assert ns is not None and ns != procs.net_ns("self")
    found = procs.in_namespaces({ns})
    assert {p.pid for p in found} == {holder.pid, child}, found
    start = time.monotonic()
    stopped, left = procs.stop(found, timeout=1.0)
    holder.wait(10)
    assert not left and {p.pid for p in stopped} == {holder.pid, child}
    assert time.monotonic() - start < 10  # SIGKILL after the timeout: SIGTERM was ignored
    assert not any(p.alive() for p in found)
    assert procs.in_namespaces({ns}) == []


def test_a_reused_pid_is_not_the_same_process() -> None:
    me = procs.in_namespaces({procs.net_ns("self")}, exclude=())
    mine = next(p for p in me if p.pid == os.getpid())
    assert mine.alive()
    impostor = procs.Proc(mine.pid, mine.start + 1, mine.ppid, mine.cmd)
    assert not impostor.alive()
    procs.stop([impostor], timeout=0.1)  # signals nothing: this test process is still here
    assert mine.alive()
