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


def test_pad_rows_split_into_segments_no_longer_than_the_longest_real_one():
    """The one attention launch sizes its grid by the longest segment: the rows a row bucket adds
    past the images come as segments no longer than theirs (4 rows at least, a merge unit)."""
    from vlmserve.models.qwen2_vl.embedding import pad_segments

    assert pad_segments(448, 64) == [64] * 7
    assert pad_segments(500, 64) == [64] * 7 + [52]
    assert pad_segments(12, 1024) == [12]
    assert pad_segments(8, 2) == [4, 4]
    assert pad_segments(0, 64) == []


def test_a_call_whose_padded_segments_would_take_cudnn_keeps_its_rows(monkeypatch):
    """127 images of 256 patches: alone their segments stay under cuDNN's threshold, but a pad of
    256 rows joins their run (128 of them: a cuDNN piece's work), so that call is not padded."""
    import numpy as np

    from vlmserve.engine.ops import cuda_kernels
    from vlmserve.models.qwen2_vl import vision_attention
    from vlmserve.models.qwen2_vl.adapter import QwenVLModel

    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: True)
    model = object.__new__(QwenVLModel)  # only the padding decision: no weights
    model.pads_tower_rows = True
    many = np.array([[1, 16, 16]] * 127)
    assert not vision_attention.may_take_cudnn([256] * 127) and vision_attention.may_take_cudnn([256] * 128)
    assert model._tower_rows(many) is None
    assert model._tower_rows(np.array([[1, 16, 16]] * 3)) == 1024  # 768 patches: padded
