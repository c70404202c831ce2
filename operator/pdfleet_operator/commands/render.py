"""`pdfleet render -f FILE [-o yaml|json]`: every object the operator would create, without a cluster.

Like `helm template`: the admission verdict first (exit 1 with it when any object would be denied),
then the Pods, Services, ConfigMaps, policy and RBAC of each PDDeployment, exactly as the operator's
first reconcile pass builds them (one code path: pdfleet_operator.render).

`pdfleet render --diff NAME [-n NS]`: what this release's rendering would change in a running deployment,
read from the cluster ($KUBECONFIG): per role, the revision its pods run and the one this release gives
(a different one is a rollout of the role once this release's operator runs), and the fields that differ.
Run the new release's CLI before `helm upgrade`. Exit 0: nothing rolls; 1: a role rolls (as `kubectl diff`);
2: the deployment could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from pdfleet_operator.commands.render_diff import run_diff
from pdfleet_operator.commands.validate import _read, format_verdict
from pdfleet_operator.render import Rendered, render_text

__all__ = ["dump_yaml", "register", "run"]


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def dump_yaml(objects: list[dict]) -> str:
    return "".join("---\n" + yaml.dump(o, Dumper=_NoAliases, sort_keys=False) for o in objects)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print every object the operator would create (no cluster)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("-f", "--filename", dest="files", action="extend", nargs="+", metavar="FILE",
                   help="YAML file(s) with PDDeployments; - reads stdin")
    p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="output format")
    p.add_argument("--diff", metavar="NAME", help="compare a running PDDeployment's pods with this release's "
                   "rendering (reads the cluster: $KUBECONFIG)")
    p.add_argument("-n", "--namespace", default="default", help="the namespace of --diff's deployment")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.diff is not None:
        if args.files:
            print("error: --diff reads the cluster; give it without -f", file=sys.stderr)
            return 2
        return run_diff(args.diff, args.namespace, args.output)
    if not args.files:
        print("error: give -f FILE (what would be created) or --diff NAME (what would change)", file=sys.stderr)
        return 2
    results: list[Rendered] = []
    for name in args.files:
        text, source = _read(name)
        if text is None:
            print(f"error: {source}", file=sys.stderr)
            return 1
        results += render_text(text, source)
    if not results:
        print("error: no documents", file=sys.stderr)
        return 1
    denied = [r for r in results if not r.verdict.admitted]
    if denied:
        for r in denied:
            print(format_verdict(r.verdict), file=sys.stderr)
        print(f"{len(denied)} of {len(results)} object(s) would be denied: nothing rendered", file=sys.stderr)
        return 1
    objects = [o for r in results for o in r.objects]
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        sys.stdout.write(dump_yaml(objects))
    for r in results:
        for w in r.verdict.warnings:
            print(f"warning: {r.verdict.source} {w.rule}: {w.message}", file=sys.stderr)
    return 0
