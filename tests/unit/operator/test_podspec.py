"""The harness kubelet's pure part: $(VAR) expansion, env resolution, hooks, resolv.conf; the ranges."""

from __future__ import annotations

import ipaddress

import pytest

from pdfleet_devcluster import podspec, sandbox
from pdfleet_devcluster.podspec import Exec, HttpGet, PodSpecError
from pdfleet_devcluster.sandbox import Ranges

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "a"}},
       "spec": {"nodeName": "n0", "serviceAccountName": "sa", "hostname": "h", "subdomain": "sub"},
       "status": {"podIP": "10.64.0.5", "hostIP": "10.64.0.1"}}


@pytest.mark.parametrize(("text", "want"), [
    ("$(A)-$(B)", "1-two"),
    ("$$(A)", "$(A)"),          # escaped: stays a reference, as written
    ("$(MISSING)", "$(MISSING)"),  # undefined: as written
    ("$A $(A", "$A $(A"),
    ("a$$b", "a$b"),
])
def test_expand_follows_the_kubelet_rules(text: str, want: str) -> None:
    assert podspec.expand(text, {"A": "1", "B": "two"}) == want


def test_env_resolves_in_order_with_field_refs_and_keys() -> None:
    container = {"name": "c", "env": [
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "URL", "value": "http://$(IP):$(PORT)"},  # PORT is defined later: stays as written
        {"name": "PORT", "value": "80"},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
    ]}
    env = podspec.container_env(POD, container, lambda kind, name, key: f"{kind}/{name}/{key}", {"BASE": "b"})
    assert env == {"BASE": "b", "IP": "10.64.0.5", "URL": "http://10.64.0.5:$(PORT)", "PORT": "80", "APP": "a",
                   "K": "configMap/cm/k"}


def test_a_missing_key_or_unsupported_field_names_the_variable() -> None:
    missing = {"name": "c", "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "x"}}}]}
    with pytest.raises(PodSpecError, match="env S: secret 's' has no key 'x'"):
        podspec.container_env(POD, missing, lambda *_: None)
    odd = {"name": "c", "env": [{"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]}
    with pytest.raises(PodSpecError, match="env R"):
        podspec.container_env(POD, odd, lambda *_: None)


def test_hooks_and_named_ports() -> None:
    c = {"name": "c", "ports": [{"name": "http", "containerPort": 8080}],
         "lifecycle": {"preStop": {"httpGet": {"path": "/drain", "port": "http"}},
                       "postStart": {"exec": {"command": ["true"]}}}}
    assert podspec.hook(c, "preStop") == HttpGet("/drain", 8080)
    assert podspec.hook(c, "postStart") == Exec(("true",))
    assert podspec.hook({"name": "x"}, "preStop") is None
    with pytest.raises(PodSpecError, match="no port named 'grpc'"):
        podspec.port_number(c, "grpc")


def test_resolv_conf_and_hosts() -> None:
    assert podspec.resolv_conf("ns", "10.160.0.10") == (
        "search ns.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.160.0.10\noptions ndots:5\n")
    assert "10.64.0.5\th.sub.ns.svc.cluster.local h\n" in podspec.hosts(POD)


def test_ranges_differ_per_index_and_hold_their_addresses() -> None:
    a, b = Ranges(0), Ranges(1)
    nets = [ipaddress.ip_network(n) for n in (a.pod_cidr, a.service_cidr, b.pod_cidr, b.service_cidr)]
    assert not any(x.overlaps(y) for i, x in enumerate(nets) for y in nets[i + 1:])
    assert ipaddress.ip_address(a.gateway) in nets[0] and ipaddress.ip_address(a.dns_service_ip) in nets[1]
    assert ipaddress.ip_address(a.kubernetes_service_ip) in nets[1]


HOST_ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""
INSIDE_ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
pdf0\t0000400A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""


def test_the_route_check_reads_the_table_without_sending(tmp_path) -> None:
    host, inside = tmp_path / "host", tmp_path / "inside"
    host.write_text(HOST_ROUTES)
    inside.write_text(INSIDE_ROUTES)
    assert sandbox.routed("192.0.2.1", host) and sandbox.routed("8.8.8.8", host)
    assert not sandbox.routed("192.0.2.1", inside) and sandbox.routed("10.64.3.4", inside)
    assert not sandbox.routed("10.65.0.1", inside)


def test_a_host_path_is_checked_as_its_type_says_before_the_pod_starts(tmp_path) -> None:
    from pdfleet_devcluster.podsandbox import host_path

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert host_path("p", "model", {"path": str(model), "type": "Directory"}) == model
    assert host_path("p", "model", {"path": str(model / "config.json"), "type": "File"}) == model / "config.json"
    assert host_path("p", "model", {"path": str(model)}) == model
    made = host_path("p", "cache", {"path": str(tmp_path / "new" / "dir"), "type": "DirectoryOrCreate"})
    assert made.is_dir()
    cases = [
        ({"path": str(tmp_path / "missing"), "type": "Directory"}, "is not an existing directory on the host"),
        ({"path": str(model / "config.json"), "type": "Directory"}, "is not an existing directory on the host"),
        ({"path": str(model), "type": "File"}, "is not an existing file on the host"),
        ({"path": str(tmp_path / "missing")}, "is not an existing path on the host"),
        ({"path": "models/zen", "type": "Directory"}, "needs an absolute path"),
        ({"path": str(model), "type": "Socket"}, "of type 'Socket' is not supported by the harness's kubelet"),
    ]
    for src, why in cases:
        with pytest.raises(PodSpecError, match="pod p: hostPath volume 'model'") as err:
            host_path("p", "model", src)
        assert why in str(err.value), (src, str(err.value))
