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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rotate_qk_equals_mlx_vlm_rotation_of_q_and_k(grid_server, dtype):
    """One rotation for q and k (a CUDA kernel on that backend) is bit-identical to mlx_vlm's
    apply_rotary_pos_emb_vision on each of them."""
    import sys

    attn = grid_server.engine.scheduler.vlm.model.vision_tower.blocks[0].attn
    rotary = sys.modules[type(attn).__mro__[1].__module__].apply_rotary_pos_emb_vision

    def compare():
        import mlx.core as mx

        seq, heads, dim = 300, 3, 16
        qkv = (mx.random.normal((seq, 3, heads, dim), key=mx.random.key(4)) * 4).astype(getattr(mx, dtype))
        freqs = mx.random.uniform(0, 40, (seq, dim // 2), key=mx.random.key(5))
        ours = vision_attention.rotate_qk(qkv, freqs, rotary)
        q = rotary(qkv[None, :, 0], freqs)[0]
        k = rotary(qkv[None, :, 1], freqs)[0]
        return np.array(ours.astype(mx.float32)), np.array(mx.stack([q, k], axis=1).astype(mx.float32))

    ours, ref = grid_server.on_worker(compare)
    assert ours.shape == ref.shape == (300, 2, 3, 16)
    np.testing.assert_array_equal(ours, ref)
