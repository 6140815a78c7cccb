"""_tower_calls: the requests of one step go through the vision tower in order, as few calls as
TOWER_PATCHES patches each allow; an image larger than that goes alone."""

from __future__ import annotations

import numpy as np

from vlmserve.models.qwen2_vl.adapter import TOWER_PATCHES, _tower_calls


def test_calls_take_requests_in_order_up_to_the_patch_bound():
    sizes = {"a": 3000, "b": 3000, "c": 3000, "big": TOWER_PATCHES + 1, "small": 100, "two": 2000}
    requests = list(sizes)
    # (1, 1, n) grids; "two" has two images of 1000 patches each.
    grids = {id(r): np.array([[1, 1, n]]) for r, n in sizes.items() if r != "two"}
    grids[id(requests[-1])] = np.array([[1, 1, 1000], [1, 1, 1000]])
    calls = _tower_calls(requests, grids)
    assert calls == [["a", "b"], ["c"], ["big"], ["small", "two"]]
