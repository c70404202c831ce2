"""The one place that builds Kubernetes API clients: every call gets a deadline and TCP keepalive.

Used by the runtime's gate writer and by the operator (its reconcile client, and kopf's own
networking settings). Without a deadline, a call against an apiserver that accepts a connection and
never answers (a hung apiserver, a half-open connection after a network change) blocks forever, and
the operator's reconcile thread keeps its PDDeployment's lock. A watch made with these clients (tests
use them) gets the connect deadline only, since it is silent while nothing changes; kopf watches
with its own settings, derived from the same ``ApiDeadlines``.

Pure but for the lazy ``kubernetes`` import, so the operator may import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEFAULT_DEADLINES", "ApiDeadlines", "api_client", "in_cluster_or_kubeconfig"]


class ApiDeadlines(BaseModel):
    """Per-request deadlines and keepalive of every Kubernetes API client of the project."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_s: float = Field(5.0, gt=0, description="TCP connect and TLS handshake (an apiserver answers in ms).")
    read_s: float = Field(15.0, gt=0, description="Between bytes of a response; no single read or write "
                          "the project makes takes longer (lists are of one deployment's pods).")
    retries: int = Field(1, ge=0, description="Connection retries (a read that timed out is never retried: "
                         "the caller's next pass or tick retries, so one call costs at most about "
                         "(retries + 1) * connect_s + read_s).")
    keepalive_idle_s: int = Field(30, ge=1, description="TCP keepalive: first probe after this idle time "
                                  "(client-go's 30 s).")
    keepalive_interval_s: int = Field(10, ge=1, description="TCP keepalive: between probes.")
    keepalive_count: int = Field(3, ge=1, description="TCP keepalive: unanswered probes before the kernel "
                                 "drops the connection.")

    @property
    def request_timeout(self) -> tuple[float, float]:
        """urllib3's (connect, read) pair, the kubernetes client's ``_request_timeout``."""
        return (self.connect_s, self.read_s)

    @property
    def total_s(self) -> float:
        """A bound on one request, for clients that take a single number (kopf's aiohttp session)."""
        return (self.retries + 1) * self.connect_s + self.read_s


DEFAULT_DEADLINES = ApiDeadlines()


def _deadline_client_class() -> type:
    from kubernetes.client import ApiClient

    class DeadlineApiClient(ApiClient):
        """An ApiClient whose requests default to the deadlines (an explicit ``_request_timeout`` wins)."""

        deadlines: ApiDeadlines = DEFAULT_DEADLINES

        def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
            timeout = _request_timeout
            if timeout is None:
                url = str(kwargs.get("url", args[1] if len(args) > 1 else ""))
                # A watch is silent while nothing changes: only its connect gets a deadline; the
                # server's timeoutSeconds ends it and keepalive finds a dead peer.
                watching = "watch=true" in url.lower()
                timeout = (self.deadlines.connect_s, None) if watching else self.deadlines.request_timeout
            return super().call_api(*args, _request_timeout=timeout, **kwargs)

    return DeadlineApiClient


def _harden(configuration: Any, deadlines: ApiDeadlines) -> None:
    import urllib3
    from kubernetes.utils.keepalive import tcp_keepalive_socket_options

    configuration.socket_options = tcp_keepalive_socket_options(
        deadlines.keepalive_idle_s, deadlines.keepalive_interval_s, deadlines.keepalive_count
    )
    configuration.retries = urllib3.Retry(total=deadlines.retries, connect=deadlines.retries, read=0,
                                          status=0, other=0, redirect=False, raise_on_status=False)


def api_client(kubeconfig: Path | str | None = None, *, in_cluster: bool = False,
               deadlines: ApiDeadlines = DEFAULT_DEADLINES) -> Any:
    """A ``kubernetes.client.ApiClient`` with ``deadlines`` on every call.

    ``in_cluster``: the mounted ServiceAccount token; else ``kubeconfig`` (None: ``$KUBECONFIG`` or
    ``~/.kube/config``, as kubectl).
    """
    from kubernetes import config
    from kubernetes.client import Configuration

    configuration = Configuration()
    if in_cluster:
        config.load_incluster_config(client_configuration=configuration)
    else:
        path = str(kubeconfig) if kubeconfig is not None else os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
    _harden(configuration, deadlines)
    client = _deadline_client_class()(configuration)
    client.deadlines = deadlines
    return client


def in_cluster_or_kubeconfig(deadlines: ApiDeadlines = DEFAULT_DEADLINES) -> Any:
    """In-cluster credentials first, then KUBECONFIG (the same order as kopf's logins)."""
    from kubernetes import config

    try:
        return api_client(in_cluster=True, deadlines=deadlines)
    except config.ConfigException:
        return api_client(deadlines=deadlines)
