"""Runtime pods are locked down (issue 26, item 5): a read-only root filesystem with a size-limited
writable /tmp, and a size-limited /dev/shm (a memory-backed emptyDir without a limit can take the
node's memory). The real apiserver accepts them: tests/cluster/test_hardening.py dry-runs every
generated object, and Pod Security Admission's `restricted` level admits tcp and shm pods."""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from tests.unit.operator.test_plan import base_spec


def test_runtime_pods_have_a_read_only_root_and_bounded_scratch_space() -> None:
    spec = base_spec(replicas=1)
    for role in Role:
        pod = runtime_pod("demo", "ns", spec, role, role_revision(spec, role), 0)["spec"]
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm.get("sizeLimit"), shm
        tmp = volumes[mounts["/tmp"]]["emptyDir"]
        assert tmp.get("sizeLimit"), tmp
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("TMPDIR") == "/tmp" and env.get("HOME") == "/tmp"
