"""What the cluster's one node runs besides the pods: CoreDNS and kube-proxy, and what they need.

Both run as processes of the cluster's private namespace (the node every kwok pod's sandbox hangs
off), with the admin kubeconfig as a node component would have its own:

- CoreDNS (built with the plugins named in ``toolchain.COREDNS_PLUGINS``) serves ``cluster.local``
  from the API on every address of the namespace, port 53; the ``kube-dns`` Service in kube-system
  holds the cluster's DNS address (what every pod's resolv.conf names) and an EndpointSlice of the
  node's address, so kube-proxy forwards it to CoreDNS as it would to CoreDNS pods;
- kube-proxy in nftables mode DNATs ClusterIPs to ready endpoints. ``--masquerade-all``: pods
  share one L2 bridge, so a reply from the chosen endpoint would go straight back to the client,
  skipping the node's un-DNAT; masquerading makes it return through the node (what br_netfilter
  does on a real node, which a network namespace cannot switch on).
"""

from __future__ import annotations

from pathlib import Path

from pdfleet_devcluster.podspec import CLUSTER_DOMAIN
from pdfleet_devcluster.sandbox import Ranges

__all__ = ["coredns_args", "corefile", "kube_dns_objects", "kube_proxy_args"]


def corefile(kubeconfig: Path, health_port: int, ready_port: int) -> str:
    return f""".:53 {{
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 1
    }}
}}
"""


def coredns_args(conf: Path) -> list[str]:
    return [f"-conf={conf}"]


def kube_dns_objects(ranges: Ranges) -> list[dict]:
    """The kube-dns Service (the DNS address pods use) and its EndpointSlice: the node, port 53."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    labels = {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"clusterIP": ranges.dns_service_ip, "ports": [{**p, "targetPort": 53} for p in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "devcluster.pdfleet.io"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [ranges.gateway], "conditions": {"ready": True}}],
         "ports": ports},
    ]


def kube_proxy_args(kubeconfig: Path, ranges: Ranges, node: str, metrics_port: int, healthz_port: int) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}", "--proxy-mode=nftables", f"--hostname-override={node}",
        f"--cluster-cidr={ranges.pod_cidr}", "--masquerade-all",
        "--conntrack-max-per-core=0",  # nf_conntrack_max is the host's: not writable from a namespace
        f"--metrics-bind-address=127.0.0.1:{metrics_port}", f"--healthz-bind-address=127.0.0.1:{healthz_port}",
        "--v=1",
    ]
