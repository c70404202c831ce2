"""Which sglang-router workers the router pod's sweeper deletes: those no pod of their role stands behind."""

from __future__ import annotations

from types import SimpleNamespace

from pdfleet_runtime.front.stale_workers import (
    RouterWorker,
    SelectedPod,
    stale_workers,
    sweeper_from_router_args,
)


def _w(url: str, kind: str) -> RouterWorker:
    return RouterWorker(id=f"id-{url}", url=url, worker_type=kind)


def test_a_worker_whose_address_now_belongs_to_the_other_role_is_stale() -> None:
    """The CI case: the drained prefill at 10.65.0.6 was deleted and a new decode got its address."""
    workers = [_w("http://10.65.0.6:8080", "prefill"), _w("http://10.65.0.7:8080", "decode"),
               _w("http://10.65.0.8:8080", "prefill")]
    pods = [SelectedPod(name="d-new", ip="10.65.0.6", role="decode"), SelectedPod(name="d-0", ip="10.65.0.7",
                                                                                    role="decode"),
            SelectedPod(name="p-1", ip="10.65.0.8", role="prefill")]
    found = stale_workers(workers, pods)
    assert [s.worker.url for s in found] == ["http://10.65.0.6:8080"]
    assert "d-new (decode), not a prefill" in found[0].reason


def test_a_worker_without_a_pod_is_stale_and_pods_being_deleted_still_count() -> None:
    workers = [_w("http://10.0.0.1:8080", "decode"), _w("http://10.0.0.2:8080", "decode")]
    pods = [SelectedPod(name="d-draining", ip="10.0.0.2", role="decode")]  # listed until it is gone
    found = stale_workers(workers, pods)
    assert [s.worker.url for s in found] == ["http://10.0.0.1:8080"]
    assert found[0].reason == "no decode pod has the address 10.0.0.1 any more"


def test_regular_workers_and_matching_pods_are_left_alone() -> None:
    workers = [_w("http://10.0.0.3:8080", "regular"), _w("http://10.0.0.4:8080", "prefill"),
               _w("http://[fd00::5]:8080", "decode")]
    pods = [SelectedPod(name="p", ip="10.0.0.4", role="prefill"), SelectedPod(name="d", ip="fd00::5", role="decode")]
    assert stale_workers(workers, pods) == []


def _args(**kw: object) -> SimpleNamespace:
    base = dict(pd_disaggregation=True, service_discovery=True, service_discovery_namespace="ns",
                prefill_selector={"role": "prefill"}, decode_selector={"role": "decode"}, host="127.0.0.1",
                port=30001, control_plane_api_keys=[("pdfleet", "pdfleet-operator", "k3y", "admin")])
    return SimpleNamespace(**{**base, **kw})


def test_the_sweeper_runs_only_for_pd_discovery_with_an_admin_key() -> None:
    sweeper = sweeper_from_router_args(_args(host="0.0.0.0"), list_pods=lambda ns, sel: [])
    assert sweeper is not None
    assert sweeper.router_url == "http://127.0.0.1:30001" and sweeper.namespace == "ns"
    assert sweeper.selectors == {"prefill": {"role": "prefill"}, "decode": {"role": "decode"}}
    for off in (dict(service_discovery=False), dict(pd_disaggregation=False), dict(decode_selector={}),
                dict(control_plane_api_keys=[("u", "user", "k", "user")])):
        assert sweeper_from_router_args(_args(**off), list_pods=lambda ns, sel: []) is None, off
