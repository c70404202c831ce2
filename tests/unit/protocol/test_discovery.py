"""Resolvers: headless-Service DNS (exercised with ``localhost``), and the loopback static and file lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfleet_runtime.protocol.discovery import (
    DnsResolver,
    Endpoint,
    FileResolver,
    ResolveError,
    StaticResolver,
)


def test_dns_resolves_every_address_with_the_fixed_port() -> None:
    eps = DnsResolver("localhost", 8998).resolve()
    assert eps and all(e.port == 8998 for e in eps) and any(e.host in ("127.0.0.1", "::1") for e in eps)
    with pytest.raises(ResolveError, match="cannot resolve"):
        DnsResolver("no-such-prefill.invalid", 8998).resolve()


def test_file_resolver_sees_a_rewrite_as_a_restarted_pod(tmp_path: Path) -> None:
    path = tmp_path / "eps.json"
    r = FileResolver(path)
    with pytest.raises(ResolveError):
        r.resolve()
    FileResolver.write(path, [Endpoint("127.0.0.1", 4000)])
    assert r.resolve() == [Endpoint("127.0.0.1", 4000)]
    FileResolver.write(path, [Endpoint("127.0.0.1", 4001), Endpoint("127.0.0.1", 3999)])
    assert r.resolve() == [Endpoint("127.0.0.1", 3999), Endpoint("127.0.0.1", 4001)]
    path.write_text("[\"garbage\"]")
    with pytest.raises(ResolveError, match="lists no prefill endpoint"):
        r.resolve()


def test_static_resolver_and_urls() -> None:
    r = StaticResolver([])
    with pytest.raises(ResolveError):
        r.resolve()
    r.set([Endpoint("::1", 80)])
    assert r.resolve()[0].url("/v1") == "http://[::1]:80/v1"
