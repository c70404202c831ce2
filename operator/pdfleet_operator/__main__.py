"""`pdfleet-operator` (also `python -m pdfleet_operator`): run the operator.

Settings are read once here (``settings.OperatorSettings``) and handed to the handlers and to
kopf; nothing deeper reads the environment. Handlers go into an explicit registry
(``handlers.register``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from pdfleet_operator import __version__
from pdfleet_operator.settings import OperatorSettings, add_arguments, host_port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdfleet-operator", description="Run the pdfleet operator (kopf).")
    p.add_argument("--version", action="version", version=f"pdfleet-operator {__version__}")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch only these namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--standalone", action="store_true",
                       help="single-replica mode without kopf peering (documented: run exactly one replica)")
    peers.add_argument("--peering", metavar="NAME",
                       help="kopf peering through the KopfPeering (ClusterKopfPeering with -A) NAME, which "
                       "must exist: of several replicas only the one with the highest --priority reconciles; "
                       "all serve the webhook")
    p.add_argument("--priority", type=int, metavar="N",
                   help="peering priority (default: drawn at random at start, so replicas never tie)")
    p.add_argument("--resync-seconds", type=float, default=10.0,
                   help="reconcile every PDDeployment at least this often (default 10)")
    p.add_argument("--autoscale-interval-seconds", type=float, default=15.0, metavar="S",
                   help="an autoscaling pass per PDDeployment with spec.autoscaling this often (default 15)")
    p.add_argument("--max-parallel-reconciles", type=int, default=4, metavar="N",
                   help="reconcile passes at once, across PDDeployments (default 4)")
    p.add_argument("--metrics-listen", default="0.0.0.0:8081", metavar="HOST:PORT",
                   help="Prometheus /metrics endpoint (default 0.0.0.0:8081; empty disables)")
    p.add_argument("--hub-endpoint", default="https://huggingface.co", metavar="URL",
                   help="the Hugging Face Hub that resolves a huggingFace.revision branch or tag to its commit "
                   "(once per name; a mirror, or a test's stand-in)")
    p.add_argument("--no-router-generations", dest="router_generations", action="store_false",
                   help="routers pair whatever pods their selectors find, of any generation (default: one generation "
                   "at a time, docs/router.md); for comparison: the decodes refuse pairs across generations")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (default INFO)")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = OperatorSettings.from_args(args)
    except (ValidationError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    import kopf

    from pdfleet_operator import handlers
    from pdfleet_operator.admission import WebhookSetupError

    kopf.configure(verbose=args.verbose)
    if not args.verbose:  # one access-log line per admission request is noise on the apiserver's hot path
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        # Likewise one line per child event ("Handler 'child-pods' succeeded."): the pass it wakes logs.
        logging.getLogger("kopf.objects").addFilter(
            lambda r: not (str(r.msg).startswith("Handler 'child-") and str(r.msg).endswith("succeeded.")))
    from pdfleet_operator import metrics

    metrics.count_watch_restarts(verbose=args.verbose)
    if settings.metrics_listen:
        metrics.serve(*host_port(settings.metrics_listen))
    registry = kopf.OperatorRegistry()
    kopf_settings = settings.kopf_settings()
    try:
        handlers.register(registry, settings, kopf_settings)
    except WebhookSetupError as exc:
        print(f"pdfleet-operator: {exc}", file=sys.stderr)
        return 2
    asyncio.run(
        kopf.operator(
            registry=registry,
            settings=kopf_settings,
            standalone=settings.standalone,
            peering_name=settings.peering,
            priority=settings.peering_priority(),
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            liveness_endpoint=settings.liveness,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
