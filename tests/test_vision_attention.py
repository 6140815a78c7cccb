"""Qwen-VL towers: the run-batched vision attention gives the same features as mlx_vlm's
one-kernel-per-segment attention, with fewer attention launches."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import start_server
from vlmserve.engine import vision_attention
from vlmserve.engine.vision_attention import segment_runs

# Equal sizes (batched together), an odd size between them, and a two-frame grid.
GRIDS = [(1, 16, 16), (1, 16, 16), (1, 8, 12), (1, 16, 16), (1, 16, 16), (2, 4, 4)]


def test_segment_runs_groups_consecutive_equal_lengths():
    assert segment_runs([0, 4, 8, 12, 15, 18, 20]) == [(0, 3, 4), (12, 2, 3), (18, 1, 2)]
    assert segment_runs([0, 5, 5, 9]) == [(0, 1, 5), (5, 1, 4)]  # empty segments are skipped
    assert segment_runs([0]) == []


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def grid_server(request):
    server = start_server(request.param)
    yield server
    server.stop()


def test_batched_segments_equal_per_segment_attention(grid_server):
    vlm = grid_server.state.engine.scheduler.vlm

    def compare():
        import mlx.core as mx

        tower = vlm.model.vision_tower
        vc = vlm.model.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        pixels = mx.random.normal((sum(t * h * w for t, h, w in GRIDS), dim), key=mx.random.key(0))
        grid = mx.array(GRIDS)
        names = [type(block.attn).__name__ for block in tower.blocks]
        original_sdpa = mx.fast.scaled_dot_product_attention
        calls = []

        def counting_sdpa(*args, **kwargs):
            calls.append(1)
            return original_sdpa(*args, **kwargs)

        mx.fast.scaled_dot_product_attention = counting_sdpa
        try:
            batched = np.array(tower(pixels, grid, output_hidden_states=False).astype(mx.float32))
            n_batched = len(calls)
            vision_attention.uninstall(tower)  # mlx_vlm's own attention
            reference = np.array(tower(pixels, grid, output_hidden_states=False).astype(mx.float32))
            n_reference = len(calls) - n_batched
        finally:
            mx.fast.scaled_dot_product_attention = original_sdpa
            vision_attention.install(tower)
        return names, batched, reference, n_batched, n_reference

    names, batched, reference, n_batched, n_reference = grid_server.on_worker(compare)
    assert all(n.startswith("Segment") for n in names)
    np.testing.assert_allclose(batched, reference, rtol=1e-5, atol=1e-6)
    assert 0 < n_batched < n_reference
