"""The local control plane used by `pdfleet dev` and the cluster tests.

``toolchain`` builds the binaries from Go modules; ``cluster`` starts and
stops them; ``certs`` makes the throw-away PKI; ``sandbox`` is the cluster's
private network namespace; ``node`` runs CoreDNS and kube-proxy; ``kubelet``,
``podsandbox`` and ``podspec`` are the harness's kubelet and container runtime.
"""

from pdfleet_operator.devcluster import sandbox
from pdfleet_operator.devcluster.cluster import ClusterError, ClusterOptions, LocalCluster
from pdfleet_operator.devcluster.toolchain import ToolchainError, cache_root, ensure_toolchain

__all__ = [
    "ClusterError",
    "ClusterOptions",
    "LocalCluster",
    "ToolchainError",
    "cache_root",
    "ensure_toolchain",
    "sandbox",
]
