"""The local control plane used by `pdfleet dev`, `pdfleet demo` and the cluster tests (a package beside the
operator's: the operator never imports it but for those two commands).

``toolchain`` builds the binaries from Go modules; ``cluster`` starts and
stops them (its throw-away PKI from ``pdfleet_operator.certs``); ``sandbox`` is the cluster's
private network namespace; ``node`` runs CoreDNS and kube-proxy; ``kubelet``,
``podsandbox`` and ``podspec`` are the harness's kubelet and container runtime.
"""

from pdfleet_devcluster import sandbox
from pdfleet_devcluster.cluster import ClusterError, ClusterOptions, LocalCluster
from pdfleet_devcluster.toolchain import ToolchainError, cache_root, ensure_toolchain

__all__ = [
    "ClusterError",
    "ClusterOptions",
    "LocalCluster",
    "ToolchainError",
    "cache_root",
    "ensure_toolchain",
    "sandbox",
]
