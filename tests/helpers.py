"""Small test utilities shared by every test package."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], *, what: str, timeout: float = 60.0, interval: float = 0.2) -> T:
    """Poll ``cond`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last value: {last!r})")


def delete_namespace_and_pods(cluster: Any, ns: str, timeout: float = 120.0) -> None:
    """Delete a module's own namespace and wait until its pods are gone: a test worker's cluster is shared
    by every test file it runs, and pods left behind hold the GPUs the next file's pods are scheduled on."""
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    wait_until(lambda: cluster.kubectl("-n", ns, "get", "pods", "-o", "name", check=False).stdout.strip() == "",
               what=f"namespace {ns}'s pods gone", timeout=timeout)


IDENTITY = textwrap.dedent("""
    import json, os
    from kubernetes import client, config
    config.load_incluster_config()   # the pod's token at /var/run/secrets/kubernetes.io/serviceaccount
    core = client.CoreV1Api()
    ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
    out = {}
    for what, call in (("get own pod", lambda: core.read_namespaced_pod(os.environ["POD_NAME"], ns)),
                       ("list secrets", lambda: core.list_namespaced_secret(ns))):
        try:
            call()
            out[what] = 200
        except client.ApiException as e:
            out[what] = e.status
    print(json.dumps(out))
""")
"""Run inside a pod (``python -c``): what its own ServiceAccount token may do, as JSON."""
