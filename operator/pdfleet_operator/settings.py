"""Operator settings: one pydantic model, read once at start from the command line.

Nothing deeper reads the environment or argv; handlers and the webhook server get these values
when they are built. ``kopf_settings()`` turns them into kopf's own ``OperatorSettings``.

Admission has three modes (``WebhookMode``):

- ``off`` (default): no webhook server; the apiserver's schema and CEL still apply, and stored
  objects still get ``Admitted``/``Degraded`` from the re-check handlers.
- ``serve`` (production): listen with the certificate files of a mounted Secret; the Helm chart
  installs the ValidatingWebhookConfiguration, so the operator needs no RBAC on webhook
  configurations.
- ``dev`` (opt-in, local clusters): issue a throw-away CA and serving certificate, and let kopf
  create and patch its own ValidatingWebhookConfiguration pointing at ``https://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import secrets
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdfleet_runtime.kubeapi import DEFAULT_DEADLINES
from pdfleet_runtime.links import Backend
from pdfleet_runtime.matrix import MATRICES, Feature

if TYPE_CHECKING:
    import kopf

__all__ = [
    "PROGRESS_PREFIX",
    "AdmissionSettings",
    "OperatorSettings",
    "RecheckSettings",
    "WebhookMode",
    "add_arguments",
    "host_port",
]

# kopf keeps handler progress and the last-handled spec in annotations under this prefix, not in
# status.kopf (the CRD's structural schema would prune it).
PROGRESS_PREFIX = "pdfleet.io"
# One watch request lasts at most this long (then kopf re-lists from its resourceVersion); a watch that
# stalls without the server ending it is cut by kopf's inactivity timeout and the client timeout.
WATCH_SERVER_TIMEOUT_S = 300  # an integer: the apiserver parses timeoutSeconds as one


class WebhookMode(StrEnum):
    OFF = "off"
    SERVE = "serve"
    DEV = "dev"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AdmissionSettings(_Frozen):
    """The validating webhook: where it listens, its certificate, and what kopf manages."""

    mode: WebhookMode = Field(WebhookMode.OFF, description="off, serve (production) or dev (managed).")
    host: str = Field("0.0.0.0", description="Listen address; dev mode also puts it in the webhook URL.")
    port: int = Field(9443, ge=0, le=65535, description="Listen port; 0 picks a free one.")
    cert_dir: Path | None = Field(
        None,
        description="serve mode: directory with tls.crt and tls.key (a mounted kubernetes.io/tls Secret); "
        "kopf re-reads them when they change. dev mode: where the throw-away CA is written "
        "(default: a temporary directory).",
    )
    configuration_name: str = Field(
        "pdfleet-admission.pdfleet.io",
        description="dev mode only: the ValidatingWebhookConfiguration kopf creates and patches.",
    )
    path: str = Field("", description="URL path prefix of the webhook endpoints.")
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="Larger requests are denied unread (code 413). The apiserver never sends "
        "more: an object is at most etcd's 1.5 MiB value, and an UPDATE review carries two of them."
    )
    max_concurrent_reviews: int = Field(
        2, ge=1, description="Requests larger than inline_body_bytes read and judged at once; more wait for a "
        "turn (up to review_wait_seconds, then a denial), so memory stays near max_concurrent_reviews times "
        "what one large review takes, whatever the number of callers."
    )
    review_wait_seconds: float = Field(
        5.0, gt=0, description="How long a large request waits for a turn; below the apiserver's webhook "
        "timeout (10 s in the chart), so the caller gets our denial rather than a timeout."
    )
    body_read_seconds: float = Field(
        3.0, gt=0, description="A request's whole body must arrive within this, before a large one waits for a "
        "turn; a slower sender is denied (code 408) and cut, and holds no turn meanwhile. The apiserver sends "
        "a review at once; read, wait and judging stay within its webhook timeout (10 s in the chart)."
    )
    body_buffer_bytes: int = Field(
        64 << 20, ge=1 << 20, description="Bytes of large request bodies being read or waiting for a turn, counted "
        "as they arrive; past it a large request is denied (code 429). Room for 16 reviews of 4 MiB at once."
    )
    drain_seconds: float = Field(
        5.0, ge=0, description="On stop, the webhook keeps answering this long before it closes, each answer with "
        "Connection: close: the apiserver reuses kept-alive connections, and one closed while idle can meet a review "
        "sent on it (failed calling webhook: use of closed network connection). Also the time a terminating pod's "
        "endpoint takes to leave the Service."
    )
    inline_body_bytes: int = Field(
        256 << 10,
        ge=0,
        description="Requests up to this size are evaluated on the webhook's event loop (fast path); larger ones "
        "in a worker thread so one huge object cannot stall other reviews.",
    )


class RecheckSettings(_Frozen):
    """How stored objects are re-checked against the running matrix (the Degraded condition)."""

    interval_seconds: float = Field(
        300.0, gt=0, description="Timer re-check of every stored object; events re-check at once."
    )
    matrix_version: str | None = Field(
        None,
        description="Pin one matrix version for admission and re-checks instead of the one each role's "
        "runtime release names. Default: unpinned.",
    )
    deny_cells: tuple[str, ...] = Field(
        (),
        description="TEST HOOK: extra unsupported matrix cells, as BACKEND.FEATURE (e.g. "
        "nixl.sharded-hetero-tp), layered on the running matrix. It simulates an operator upgrade whose "
        "matrix is stricter, so the Degraded path can be tested on a real cluster. Never set in production.",
    )
    cache_size: int = Field(
        1024, ge=0, description="Verdicts cached by object content (0 disables); specs repeat a lot."
    )
    cache_bytes: int = Field(
        8 << 20, ge=0, description="Memory bound of that cache (0 disables it): many distinct large objects "
        "evict each other instead of growing the operator past its memory limit."
    )

    @field_validator("matrix_version")
    @classmethod
    def _known_version(cls, v: str | None) -> str | None:
        if v is not None and v not in MATRICES:
            raise ValueError(f"unknown matrix version {v!r}; known: {', '.join(MATRICES)}")
        return v

    @field_validator("deny_cells")
    @classmethod
    def _cells(cls, cells: tuple[str, ...]) -> tuple[str, ...]:
        for cell in cells:
            backend, _, feature = cell.partition(".")
            if backend not in set(Backend) or feature not in set(Feature):
                raise ValueError(
                    f"{cell!r} is not BACKEND.FEATURE; backends: {', '.join(Backend)}; "
                    f"features: {', '.join(Feature)}"
                )
        return cells


class OperatorSettings(_Frozen):
    """Everything the operator reads at start."""

    namespaces: tuple[str, ...] = Field((), description="Watch only these namespaces; empty: all.")
    liveness: str = Field("http://0.0.0.0:8080/healthz", description="kopf liveness endpoint URL.")
    standalone: bool = Field(False, description="No kopf peering: run exactly one replica.")
    peering: str | None = Field(
        None, description="kopf peering object name (mandatory peering); None: kopf's auto-detection of "
        "'default', or none with standalone."
    )
    priority: int | None = Field(
        None, ge=0, description="Peering priority; None: drawn at random at start. kopf lets every peer of "
        "the highest priority run (two equal ones both reconcile), so replicas must not share one."
    )
    peering_lifetime_seconds: int = Field(
        20, ge=5, description="How long a replica's keep-alive counts: a killed active replica is taken "
        "over by another after at most this long (kopf's default is 60)."
    )
    metrics_listen: str | None = Field(
        "0.0.0.0:8081", description="HOST:PORT of the Prometheus /metrics endpoint; None disables it."
    )
    resync_seconds: float = Field(
        10.0, gt=0, description="Every PDDeployment is reconciled at least this often (drift correction); "
        "child events reconcile at once."
    )
    autoscale_interval_seconds: float = Field(
        15.0, ge=1, le=600, description="An autoscaling pass per PDDeployment with spec.autoscaling this often "
        "(an HPA's sync period; docs/autoscaling.md)."
    )
    max_parallel_reconciles: int = Field(
        4, ge=1, le=64, description="Reconcile passes that run at once, across PDDeployments (each in a "
        "thread; a deployment's passes never overlap). A slow pass holds one slot, never another "
        "deployment's turn."
    )
    hub_endpoint: str = Field(
        "https://huggingface.co", pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="The Hugging Face Hub the operator asks to resolve a huggingFace.revision branch or tag to "
        "its commit (once per name; docs/model-source.md); a mirror or a test's stand-in."
    )
    router_generations: bool = Field(
        True, description="Routers pair one generation of pods at a time (docs/router.md); off: any they find."
    )
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    recheck: RecheckSettings = Field(default_factory=RecheckSettings)

    def peering_priority(self) -> int:
        """The priority to run with: the configured one, or a random one in [1, 2**31)."""
        return self.priority if self.priority is not None else secrets.randbelow(2**31 - 1) + 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OperatorSettings:
        """Build from ``add_arguments``' parsed flags; pydantic errors name the bad flag's field."""
        mode, host, port = WebhookMode.OFF, "0.0.0.0", 9443
        if args.dev_webhook:
            mode, (host, port) = WebhookMode.DEV, host_port(args.dev_webhook)
        elif args.webhook_listen:
            mode, (host, port) = WebhookMode.SERVE, host_port(args.webhook_listen)
        admission: dict[str, object] = {"mode": mode, "host": host, "port": port}
        if args.webhook_cert_dir:
            admission["cert_dir"] = Path(args.webhook_cert_dir)
        if args.webhook_configuration:
            admission["configuration_name"] = args.webhook_configuration
        if getattr(args, "webhook_drain_seconds", None) is not None:
            admission["drain_seconds"] = args.webhook_drain_seconds
        recheck: dict[str, object] = {"deny_cells": tuple(args.test_deny_cell)}
        if args.recheck_interval is not None:
            recheck["interval_seconds"] = args.recheck_interval
        if args.matrix_version is not None:
            recheck["matrix_version"] = args.matrix_version
        return cls(
            namespaces=tuple(args.namespace),
            liveness=args.liveness,
            standalone=args.standalone,
            peering=args.peering,
            priority=args.priority,
            resync_seconds=args.resync_seconds,
            autoscale_interval_seconds=getattr(args, "autoscale_interval_seconds", 15.0),
            max_parallel_reconciles=args.max_parallel_reconciles,
            metrics_listen=args.metrics_listen or None,
            hub_endpoint=getattr(args, "hub_endpoint", "https://huggingface.co"),
            router_generations=getattr(args, "router_generations", True),
            admission=AdmissionSettings.model_validate(admission),
            recheck=RecheckSettings.model_validate(recheck),
        )

    def kopf_settings(self) -> kopf.OperatorSettings:
        """kopf's settings: progress in pdfleet.io annotations; the webhook server is set by admission;
        kopf's own API calls (patches, peering, watch connects) get the project's deadlines."""
        import kopf

        s = kopf.OperatorSettings()
        s.networking.request_timeout = DEFAULT_DEADLINES.total_s
        s.networking.connect_timeout = DEFAULT_DEADLINES.connect_s
        s.watching.connect_timeout = DEFAULT_DEADLINES.connect_s
        s.watching.server_timeout = WATCH_SERVER_TIMEOUT_S  # the apiserver ends each watch; kopf resumes it
        s.watching.client_timeout = WATCH_SERVER_TIMEOUT_S + DEFAULT_DEADLINES.total_s
        s.peering.lifetime = self.peering_lifetime_seconds
        s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
        s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=PROGRESS_PREFIX, key="last-handled-configuration"
        )
        return s


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The admission and re-check flags of ``pdfleet-operator``."""
    hook = p.add_argument_group("admission webhook")
    where = hook.add_mutually_exclusive_group()
    where.add_argument(
        "--webhook-listen",
        metavar="HOST:PORT",
        help="production: serve the validating webhook with the certificate in --webhook-cert-dir; the "
        "ValidatingWebhookConfiguration is installed by the Helm chart",
    )
    where.add_argument(
        "--dev-webhook",
        metavar="HOST:PORT",
        help="local clusters: self-issued certificate, and kopf manages its own ValidatingWebhookConfiguration "
        "with clientConfig.url https://HOST:PORT (needs create/patch on webhook configurations)",
    )
    hook.add_argument("--webhook-cert-dir", metavar="DIR", help="tls.crt and tls.key (serve); CA output (dev)")
    hook.add_argument("--webhook-configuration", metavar="NAME", help="dev: managed configuration name")
    hook.add_argument("--webhook-drain-seconds", type=float, metavar="SECONDS",
                      help="on stop, answer reviews this long (each closing its connection) before closing (5)")
    recheck = p.add_argument_group("re-check of stored objects")
    recheck.add_argument("--recheck-interval", type=float, metavar="SECONDS", help="timer interval (300)")
    recheck.add_argument("--matrix-version", help="pin one capability matrix version")
    recheck.add_argument(
        "--test-deny-cell",
        action="append",
        default=[],
        metavar="BACKEND.FEATURE",
        help="TEST HOOK: treat a matrix cell as unsupported (simulates a stricter matrix after an upgrade)",
    )
