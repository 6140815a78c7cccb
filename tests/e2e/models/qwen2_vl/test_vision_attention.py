"""Qwen-VL towers: the run-batched vision attention gives the same features as mlx_vlm's
one-kernel-per-segment attention, with fewer attention launches."""

from __future__ import annotations

import numpy as np
import pytest

from support.server import start_server
from vlmserve.models.qwen2_vl import vision_attention

# Equal sizes (batched together), an odd size between them, and a two-frame grid.
GRIDS = [(1, 16, 16), (1, 16, 16), (1, 8, 12), (1, 16, 16), (1, 16, 16), (2, 4, 4)]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def grid_server(request):
    server = start_server(request.param)
    yield server
    server.stop()


def test_batched_segments_equal_per_segment_attention(grid_server):
    vlm = grid_server.state.engine.core.model

    def compare():
        import mlx.core as mx

        tower = vlm.model.vision_tower
        vc = vlm.model.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
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

    attn = grid_server.engine.core.model.model.vision_tower.blocks[0].attn
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


def _sdpa_batches(monkeypatch):
    """Record the batch size of every attention call the tower makes."""
    import mlx.core as mx

    original, batches = mx.fast.scaled_dot_product_attention, []

    def recording(q, *args, **kwargs):
        batches.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
    return batches


def test_cudnn_attention_takes_power_of_two_image_counts(grid_server, monkeypatch):
    """With cuDNN on, 7 equal images go to attention in power-of-two batches (4 + 2 + 1: bounded
    plan shapes), and the features are the same as from one call over all 7."""
    from vlmserve.engine.ops import cuda_kernels

    vlm = grid_server.state.engine.core.model
    batches = _sdpa_batches(monkeypatch)

    def features(cudnn: bool):
        import mlx.core as mx

        monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: cudnn)
        vc = vlm.model.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        grid = np.array([[1, 8, 8]] * 7)
        pixels = mx.random.normal((7 * 64, dim), key=mx.random.key(3))
        return np.array(vlm._tower(pixels, grid).astype(mx.float32))

    whole = grid_server.on_worker(features, False)
    whole_batches, batches[:] = list(batches), []
    pieces = grid_server.on_worker(features, True)
    np.testing.assert_array_equal(pieces, whole)
    # Qwen2.5-VL's windowed blocks batch windows (several per image), its full ones images.
    assert any(not _power_of_two(n) for n in whole_batches)
    assert batches and all(_power_of_two(n) for n in batches)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def test_warm_vision_plans_builds_each_power_of_two_up_to_the_limit(grid_server, monkeypatch):
    """Warm-up builds cuDNN's plans of an image size at every power-of-two image count up to
    what one call takes, and notes them: calls of those shapes find them planned."""
    from vlmserve.engine.ops import cuda_kernels
    from vlmserve.engine.ops.attention_plans import AttentionPlans

    model = grid_server.state.engine.core.model
    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: False)
    assert grid_server.on_worker(model.warm_vision_plans, (1, 8, 8), 8) == []  # no plans to build

    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: True)
    plans = AttentionPlans()
    monkeypatch.setattr(model, "attention_plans", plans)
    batches = _sdpa_batches(monkeypatch)
    assert grid_server.on_worker(model.warm_vision_plans, (1, 8, 8), 7) == [1, 2, 4]
    assert {1, 2, 4} <= set(batches) and all(_power_of_two(n) for n in batches)
    attn = model.model.vision_tower.blocks[0].attn
    dtype = model.model.vision_tower.patch_embed.proj.weight.dtype
    key = (dtype, attn.num_heads, attn.head_dim)
    assert [plans.planned((*key, n, 64)) for n in (1, 2, 4, 8)] == [True, True, True, False]
    assert grid_server.on_worker(model.warm_vision_plans, (1, 8, 8), 2) == [1, 2]


def test_warm_up_builds_as_many_images_as_one_step_can_batch(grid_server, monkeypatch):
    import numpy as np

    from vlmserve.protocol import PreparedRequest

    core = grid_server.state.engine.core
    image = core.info.image_token_id
    prepared = PreparedRequest(prompt_ids=np.array([1] + [image] * 16 + [2], np.int32), num_images=1)
    monkeypatch.setattr(core.sched, "prefill_budget", 100)
    # 16 tokens an image: a 100-token budget batches up to 7 (the 7th overshoots).
    assert core._vision_batch_limit(prepared) == 7
    monkeypatch.setattr(core.sched, "max_num_seqs", 2)
    assert core._vision_batch_limit(prepared) == 2


def test_warm_up_builds_the_tower_shapes_of_its_image_sizes(monkeypatch):
    from vlmserve.engine.ops import cuda_kernels
    from vlmserve.models.qwen2_vl.adapter import QwenVLModel

    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: True)
    grids = []
    original = QwenVLModel.warm_vision_plans

    def recording(self, grid_thw, max_images):
        grids.append(grid_thw)
        return original(self, grid_thw, max_images)

    monkeypatch.setattr(QwenVLModel, "warm_vision_plans", recording)
    server = start_server("qwen2_vl", warmup_image_sizes=(56, 112))
    try:
        assert server.client().get("/ready").status_code == 200
    finally:
        server.stop()
    assert grids == [(1, 4, 4), (1, 8, 8)]  # each warm-up image's patch grid, once
