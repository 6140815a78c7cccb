"""Ministral 3's query scale per row (models/mistral3/adapter.py) against mlx_vlm's own formula."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_each_row_takes_its_own_positions_and_padding_takes_one():
    def run():
        import mlx.core as mx
        from mlx_vlm.models.mistral4.language import _get_llama_4_attn_scale

        from vlmserve.models.mistral3.adapter import llama4_scale

        alone = [np.array(llama4_scale(start, 5, 0.1, 16)) for start in (0, 14, 40)]
        theirs = [np.array(_get_llama_4_attn_scale(start, start + 5, 0.1, 16)) for start in (0, 14, 40)]
        rows = np.array(llama4_scale(mx.array([0, 14, 40, -3], dtype=mx.int32), 5, 0.1, 16))
        scalar = np.array(llama4_scale(mx.array(14, dtype=mx.int32), 5, 0.1, 16))
        return alone, theirs, rows, scalar

    alone, theirs, rows, scalar = on_own_thread(run)
    for ours, reference in zip(alone, theirs):
        assert ours.shape == (5, 1) and np.array_equal(ours, reference)  # a row alone: mlx_vlm's values
    assert np.array_equal(scalar, theirs[1])
    assert rows.shape == (4, 1, 5, 1)
    for i in range(3):
        assert np.array_equal(rows[i, 0], theirs[i])
    assert np.isfinite(rows).all() and np.array_equal(rows[3, 0, :3, 0], np.ones(3, np.float32))  # padding: 1
