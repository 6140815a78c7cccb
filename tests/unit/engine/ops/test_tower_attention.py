"""Which attention calls tower_attention takes, and how a tower call's shapes are queued and built."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def _kernel_stand_in(shapes: list):
    """The plan-free kernel's result, computed by MLX's attention and laid out as the kernel
    returns it, (B, L, Hq * D); each call's query shape goes into `shapes`. Made on the thread
    that runs it."""
    import mlx.core as mx

    real = mx.fast.scaled_dot_product_attention

    def attend_unmasked(q, k, v, scale):
        shapes.append(q.shape)
        return real(q, k, v, scale=scale).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)

    return attend_unmasked


def test_calls_it_takes_and_leaves(monkeypatch):
    from vlmserve.engine.ops import prefill_attention, tower_attention

    monkeypatch.setattr(prefill_attention, "serves", lambda dtype, *args: str(dtype).endswith("bfloat16"))

    def run():
        import mlx.core as mx

        q = mx.zeros((2, 4, 50, 64), dtype=mx.bfloat16)
        one = mx.zeros((2, 4, 1, 64), dtype=mx.bfloat16)
        f32 = q.astype(mx.float32)
        takes = tower_attention.takes
        return [
            takes(q, q, q, None, {}),
            takes(q, q, q, mx.zeros((50, 50), dtype=mx.bool_), {}),  # a mask: MLX's route
            takes(q, q, q, "causal", {}),
            takes(q, q, q, None, {"sinks": q}),
            takes(one, one, one, None, {}),  # MLX's vector kernel, no plan
            takes(q, q[:, :, :10], q[:, :, :10], None, {}),  # not self-attention
            takes(f32, f32, f32, None, {}),  # not served
            takes(q, q, q[..., :32], None, {}),  # values of another width
            takes(q, q, f32, None, {}),  # mixed dtypes
            takes(q, q[:1], q[:1], None, {}),  # another batch
            takes(q, q, q, None, {"sinks": None, "force_fused": False}),
        ]

    assert on_own_thread(run) == [True] + [False] * 9 + [True]


def test_one_rebuild_plans_every_shape_of_its_tower_call(monkeypatch):
    """A tower call meeting two new shapes queues both with one rebuild (not due between steps
    for what little they lost); running it once, under `building()`, sends both to MLX from then
    on. The key holds the call's signature: the same shapes in another call are new."""
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.engine.ops.attention_plans import AttentionPlans

    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)
    plan_free, through_mlx = [], []

    def run():
        import mlx.core as mx

        real = mx.fast.scaled_dot_product_attention
        monkeypatch.setattr(prefill_attention, "attend_unmasked", _kernel_stand_in(plan_free))
        plans = AttentionPlans()
        a, b = mx.ones((1, 2, 8, 16), dtype=mx.bfloat16), mx.ones((3, 2, 6, 16), dtype=mx.bfloat16)

        def tower(call):
            outs = [mx.fast.scaled_dot_product_attention(x, x, x, scale=0.25) for x in (a, b)]
            mx.eval(outs)

        def rebuild():
            with tower_attention.routed(plans, "one", lambda: rebuild):
                tower("one")

        def counting(*args, **kwargs):
            through_mlx.append(args[0].shape)
            return real(*args, **kwargs)

        mx.fast.scaled_dot_product_attention = counting
        try:
            with tower_attention.routed(plans, "one", lambda: rebuild):
                tower("one")
            queued, hot = plans.pending(), plans.hot()
            plans.build_next()
            left = plans.pending()
            with tower_attention.routed(plans, "one", lambda: rebuild):
                tower("one")
            with tower_attention.routed(plans, "two", lambda: rebuild):
                tower("two")
        finally:
            mx.fast.scaled_dot_product_attention = real
        return queued, hot, left, plans.pending()

    queued, hot, left, after = on_own_thread(run)
    assert (queued, hot, left) == (2, False, 0)
    assert through_mlx == [(1, 2, 8, 16), (3, 2, 6, 16)] * 2  # the rebuild's calls, then the planned call's
    assert plan_free == [(1, 2, 8, 16), (3, 2, 6, 16)] * 2  # the first call's, then the other call's
    assert after == 2


def test_a_head_dim_the_kernel_does_not_take_is_padded_and_cut_back(monkeypatch):
    """A head dim that is not a multiple of 8 (60) runs as 64: zeros padded onto q, k and v
    change no score, and the output's padding is cut off; the result is the attention of the
    call as it came. One the kernel pads itself (SigLIP's and Qwen3-VL's 72) goes in as it is."""
    from vlmserve.engine.ops import prefill_attention, tower_attention

    monkeypatch.setattr(prefill_attention, "serves", lambda dtype, q_heads, kv_heads, dim: dim % 8 == 0)
    seen = []

    def run(dim):
        import mlx.core as mx

        real = mx.fast.scaled_dot_product_attention
        monkeypatch.setattr(prefill_attention, "attend_unmasked", _kernel_stand_in(seen))
        q, k, v = (mx.random.normal((2, 3, 10, dim), key=mx.random.key(i)) for i in range(3))
        q, k, v = (t.astype(mx.bfloat16) for t in (q, k, v))
        ours = tower_attention._plan_free(q, k, v, dim**-0.5)
        return (
            tower_attention.takes(q, k, v, None, {}),
            np.array(ours.astype(mx.float32)),
            np.array(real(q, k, v, scale=dim**-0.5).astype(mx.float32)),
        )

    for dim, kernel_dim in [(60, 64), (72, 72)]:
        seen.clear()
        taken, ours, reference = on_own_thread(lambda dim=dim: run(dim))
        assert taken and seen == [(2, 3, 10, kernel_dim)]
        assert ours.shape == reference.shape == (2, 3, 10, dim)
        np.testing.assert_allclose(ours, reference, rtol=2e-2, atol=2e-2)  # bf16: the same to its rounding
