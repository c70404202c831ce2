"""The gang rendering checked by Kueue v0.17's own code (``pdfleet_devcluster.kueue``'s pod check, built
from Go modules): Kueue's pod webhook admits every rendered pod, reads the queue, the group name, the total
count and the serving flag through its own constants as we meant them, sorts the pods of a group into one
pod role, and the gate it adds is the one observe looks for. A pod that breaks Kueue's rules is refused by
the same check, so it is not vacuous.

Opt-in (the build takes minutes cold): runs when Kueue was built already, or with ``PDFLEET_BUILD_KUEUE=1``.
"""

from __future__ import annotations

import copy
import os

import pytest

from pdfleet_devcluster.kueue import ensure_kueue, kueue_dir, podcheck
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.scheduling import (
    KUEUE_ADMISSION_GATE,
    KUEUE_GROUP_NAME_LABEL,
    KUEUE_GROUP_TOTAL_COUNT_ANNOTATION,
    SchedulingSpec,
)
from pdfleet_operator.cachedbuild import is_complete
from tests.unit.operator.test_gang import KUEUE, RACK, members, spec_with
from tests.unit.operator.test_groups import sglang_spec


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not is_complete(kueue_dir()) and os.environ.get("PDFLEET_BUILD_KUEUE") != "1":
        pytest.skip("Kueue is built on demand: PDFLEET_BUILD_KUEUE=1 (or python -m pdfleet_devcluster.kueue; "
                    "minutes cold)")
    ensure_kueue()


def _specs() -> list[PDDeploymentSpec]:
    sglang = sglang_spec(nodes=4)
    return [
        spec_with(KUEUE | {"topologyKey": RACK}),
        spec_with(KUEUE, decode_nodes=1, prefill_nodes=1),
        sglang.model_copy(update={"scheduling": SchedulingSpec.model_validate(KUEUE)}),
    ]


@pytest.mark.parametrize("spec", _specs(), ids=["builtin-2-nodes-rack", "one-node", "sglang-4-nodes"])
def test_kueue_reads_every_rendered_pod_as_one_gang_per_replica(spec: PDDeploymentSpec) -> None:
    for role in Role:
        pods = members(spec, role, index=1)
        answers = podcheck(pods)
        leader = pods[0]["metadata"]["name"]
        assert [a["name"] for a in answers] == [p["metadata"]["name"] for p in pods]
        for a in answers:
            assert a["error"] == "", a
            assert (a["queue"], a["group"], a["totalCount"], a["serving"]) == (
                "gpu-serving", leader, str(len(pods)), True)
            assert a["gate"] == KUEUE_ADMISSION_GATE
        assert len({a["roleHash"] for a in answers}) == 1  # one Kueue pod set of len(pods) pods


def test_the_check_refuses_what_kueue_refuses() -> None:
    (pod,) = members(spec_with(KUEUE, decode_nodes=1), Role.DECODE)
    no_count = copy.deepcopy(pod)
    del no_count["metadata"]["annotations"][KUEUE_GROUP_TOTAL_COUNT_ANNOTATION]
    bad_name = copy.deepcopy(pod)
    bad_name["metadata"]["labels"][KUEUE_GROUP_NAME_LABEL] = "Not_A_Name"
    zero = copy.deepcopy(pod)
    zero["metadata"]["annotations"][KUEUE_GROUP_TOTAL_COUNT_ANNOTATION] = "0"
    answers = podcheck([no_count, bad_name, zero])
    assert KUEUE_GROUP_TOTAL_COUNT_ANNOTATION in answers[0]["error"]
    assert KUEUE_GROUP_NAME_LABEL in answers[1]["error"]
    assert "greater than zero" in answers[2]["error"]
