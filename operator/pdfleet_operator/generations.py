"""Which generation the router serves, and which old pods stay until it switched (pure).

A generation is the pair of compatibility keys (``resources.compat``) the routers' selectors carry: pods of
two generations must not pair (pdfleet's protocol and vLLM's handshake refuse them), and both routers pair
whatever their selectors find. So on a change of the key:

1. the router keeps serving the old generation; the new one's pods of both roles are created into the
   surge room, and each role keeps one routable, ready pod of every older generation (``kept``);
2. once the new generation has a routable, ready prefill and decode, the router's selectors switch to it
   (``serving``): the router Deployment rolls, and a new router pod is Ready only once its router holds a
   healthy prefill and decode (both routers' ``/readiness``);
3. once the Deployment has rolled (no router pod of the earlier template is left: ``RouterState.settled``),
   nothing is kept and the old generation drains as in any rollout.

A role without surge room (``maxSurge`` 0) keeps nothing: keeping its last old pod would leave no room for
the new one, and the roll goes as before (the decodes' refusals count what crosses). docs/router.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdfleet_operator.api.constants import Role
from pdfleet_operator.observed import Generation, ObservedPod, RouterState
from pdfleet_operator.resources.names import ANNOTATION_DECODE_COMPAT, ANNOTATION_PREFILL_COMPAT

__all__ = ["kept", "mixed", "paired", "router_state", "serving"]


def router_state(deployment: Mapping | None) -> RouterState | None:
    """The router Deployment's generation and whether its rollout is done: the controller saw its current
    template and every pod it counts is of that template and available (a pod of an earlier template, still
    routing the generation before, keeps it unsettled)."""
    if deployment is None:
        return None
    meta, spec, st = deployment.get("metadata") or {}, deployment.get("spec") or {}, deployment.get("status") or {}
    notes = meta.get("annotations") or {}
    gen = (Generation(notes[ANNOTATION_PREFILL_COMPAT], notes[ANNOTATION_DECODE_COMPAT])
           if ANNOTATION_PREFILL_COMPAT in notes and ANNOTATION_DECODE_COMPAT in notes else None)
    want = int(spec.get("replicas", 1))
    settled = (int(st.get("observedGeneration", 0)) >= int(meta.get("generation", 0))
               and all(int(st.get(k, 0)) == want for k in ("replicas", "updatedReplicas", "availableReplicas"))
               and not st.get("terminatingReplicas"))
    return RouterState(gen, settled)


def _routable(p: ObservedPod) -> bool:
    return p.ready and not p.deleting and p.drain_started is None and p.member == 0


def _has_pair(gen: Generation, pods: Iterable[ObservedPod]) -> bool:
    live = [p for p in pods if _routable(p)]
    return all(any(p.role is role and p.compat == gen.of(role) for p in live) for role in Role)


def serving(target: Generation, router: RouterState | None, pods: Iterable[ObservedPod]) -> tuple[Generation, str]:
    """The generation the router's selectors carry after this pass, and why."""
    pods = list(pods)
    if router is None:
        return target, "a new router serves the target generation"
    current = router.serving
    if current == target:
        return target, "the router serves the target generation"
    if _has_pair(target, pods):
        return target, "the target generation has a ready prefill and decode: the router switches to it"
    if current is None or not _has_pair(current, pods):
        return target, "the router's generation has no ready prefill and decode left: it switches"
    return current, "the router keeps its generation until the target one has a ready prefill and decode"


def kept(role: Role, target: Generation, now_serving: Generation, router: RouterState | None,
         pods: Iterable[ObservedPod], surge: int) -> frozenset[str]:
    """The role's pods (group leaders) that must not start draining in this pass: one routable, ready pod of
    each generation other than the target's, while the router has not settled on the target."""
    if router is None or surge < 1:
        return frozenset()
    if now_serving == target and router.serving == target and router.settled:
        return frozenset()
    best: dict[str, ObservedPod] = {}
    # per older key, the pod the planner would remove last: the lowest index (rollout.removal_order)
    for p in sorted(pods, key=lambda p: (p.index, p.name), reverse=True):
        if p.role is role and _routable(p) and p.compat != target.of(role):
            best[p.compat] = p
    return frozenset(p.name for p in best.values())


def paired(pods: Iterable[ObservedPod], router: RouterState | None) -> dict[Role, dict[str, list[str]]]:
    """The routable, ready pods a router pairs, by role and compatibility key: those of the generation its
    selectors carry (the router Deployment's annotations), or every one when they carry none (no router of
    pdfleet's, or an operator run with ``--no-router-generations``)."""
    gen = router.serving if router is not None else None
    out: dict[Role, dict[str, list[str]]] = {role: {} for role in Role}
    for p in sorted(pods, key=lambda p: p.name):
        if _routable(p) and (gen is None or p.compat == gen.of(p.role)):
            out[p.role].setdefault(p.compat or "(unlabelled)", []).append(p.name)
    return out


def mixed(pods: Iterable[ObservedPod], router: RouterState | None) -> str:
    """What a router can pair across generations ('' when nothing): a role whose paired pods carry more than
    one compatibility key, each named with its pods."""
    said = []
    for role, keys in paired(pods, router).items():
        if len(keys) > 1:
            said.append(f"{role.value} pods of {len(keys)} keys (" + "; ".join(
                f"{k}: {', '.join(v)}" for k, v in sorted(keys.items())) + ")")
    return "; ".join(said)
