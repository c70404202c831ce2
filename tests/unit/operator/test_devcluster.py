"""Pure parts of the local control plane: certificates, node objects, toolchain pins, kwok Stages."""

from __future__ import annotations

import ssl
from importlib import resources
from pathlib import Path

import yaml
from cryptography import x509

from pdfleet_devcluster import toolchain
from pdfleet_devcluster.cluster import RACK_LABEL, ClusterOptions, gpu_node_manifest
from pdfleet_operator.certs import CertificateAuthority


def test_leaf_certificate_chains_to_ca_and_carries_sans(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    leaf = ca.issue("admin", common_name="admin", organizations=("system:masters",), client=True)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    cert.verify_directly_issued_by(ca.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.subject.rfc4514_string() == "O=system:masters,CN=admin"
    assert oct(leaf.key_path.stat().st_mode & 0o777) == "0o600"
    # The pair loads as a TLS server identity.
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(leaf.cert_path, leaf.key_path)


def test_gpu_node_manifest_advertises_gpus() -> None:
    node = gpu_node_manifest("kwok-gpu-0", ClusterOptions(gpus_per_node=4))
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    racks = [gpu_node_manifest(f"n{i}", ClusterOptions(), i)["metadata"]["labels"][RACK_LABEL] for i in range(3)]
    assert racks == ["rack-0", "rack-0", "rack-1"]  # a 2-node group fits in one rack only


def test_pins_key_changes_with_versions() -> None:
    a = toolchain.Pins()
    b = toolchain.Pins(kubernetes="v1.35.4")
    assert a.key() != b.key()
    assert b.staging == "v0.35.4"
    assert toolchain.toolchain_dir(a) != toolchain.toolchain_dir(b)


def test_cache_root_honours_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDFLEET_CACHE", str(tmp_path))
    assert toolchain.cache_root() == tmp_path
    assert toolchain.binary("etcd").is_relative_to(tmp_path)


def test_kwok_stages_replace_the_gate_blind_defaults() -> None:
    text = resources.files("pdfleet_devcluster").joinpath("kwok-stages.yaml").read_text()
    stages = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text)}
    assert set(stages) == {"node-initialize", "pod-start", "pod-gates-ready", "pod-gates-unready", "pod-delete",
                           "pod-delete-after-grace"}
    # Deletion waits for the hold annotation to go; a router pod, or one whose preStop sleeps, stays until its
    # deletionTimestamp.
    for name in ("pod-delete", "pod-delete-after-grace"):
        keys = [e["key"] for e in stages[name]["spec"]["selector"]["matchExpressions"]]
        assert '.metadata.annotations["pdfleet.io/hold-deletion"]' in keys
    delay = stages["pod-delete-after-grace"]["spec"]["delay"]
    assert delay["durationFrom"]["jq"]["expression"] == ".metadata.deletionTimestamp"
    # No stage marks readiness-gate conditions True by itself.
    for stage in stages.values():
        assert "range .spec.readinessGates }}\n      - lastTransitionTime" not in stage["spec"]["next"].get("statusTemplate", "")


def test_local_operator_watches_the_configuration_the_operator_manages() -> None:
    from pdfleet_devcluster.local_operator import WEBHOOK_CONFIGURATION
    from pdfleet_operator.settings import AdmissionSettings

    assert AdmissionSettings().configuration_name == WEBHOOK_CONFIGURATION


def test_the_toolchain_keeps_each_binary_that_runs_and_builds_the_rest(monkeypatch, tmp_path: Path) -> None:
    """A build stopped half-way left one good binary and one that does not run (written when it was
    killed), and no marker: the good one is kept, the rest built again, the marker written at the end;
    a later call trusts the marker and builds nothing."""
    monkeypatch.setenv("PDFLEET_CACHE", str(tmp_path))
    pins = toolchain.Pins()
    built: list[str] = []

    def write(path: Path, code: int) -> None:
        path.write_text(f"#!/bin/sh\nexit {code}\n")
        path.chmod(0o755)

    def fake_steps(pins: toolchain.Pins, out: Path, logfile: Path) -> list:
        def build(name: str):
            return lambda: (built.append(name), write(out / name, 0))
        return [((n,), build(n), n) for n in toolchain._names(pins)]

    monkeypatch.setattr(toolchain, "_steps", fake_steps)
    top = toolchain.toolchain_dir(pins)
    (top / "bin").mkdir(parents=True)
    write(top / "bin" / "etcd", 0)
    write(top / "bin" / "kube-apiserver", 3)  # starts but fails: not trusted
    out = toolchain.ensure_toolchain(pins)
    assert out == top / "bin" and (top / ".complete").exists()
    assert "etcd" not in built and "kube-apiserver" in built and "coredns" in built, built
    built.clear()
    toolchain.ensure_toolchain(pins)
    assert built == []
