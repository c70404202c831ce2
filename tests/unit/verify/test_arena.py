"""The harness's in-process copier: blocks land at their offsets; a block outside every arena is refused whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdfleet_runtime.engines import BlockRangeError
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.verify.arena import LocalCopyExecutor


def test_blocks_land_at_their_offsets_and_one_outside_is_refused_before_any_copy() -> None:
    src, dst = torch.arange(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    copier = LocalCopyExecutor([dst, src])  # any order
    s, d = src.data_ptr(), dst.data_ptr()
    copier.execute(Blocks(np.array([s + 5, s + 50]), np.array([d + 10, d]), np.array([3, 2])))
    assert dst[10:13].tolist() == [5, 6, 7] and dst[0:2].tolist() == [50, 51]
    before = dst.clone()
    with pytest.raises(BlockRangeError, match="local"):
        copier.execute(Blocks(np.array([s, s + 98]), np.array([d + 20, d + 30]), np.array([1, 3])))
    assert torch.equal(dst, before)  # the good block of the batch was not copied either
