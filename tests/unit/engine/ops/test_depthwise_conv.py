"""The plan-free depthwise convolution (engine/ops/depthwise_conv.py) against MLX's conv1d
(the hybrid families' tokens with it: integration/engine/ops/test_depthwise_conv.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread


@pytest.mark.parametrize("padding", [0, 2])
@pytest.mark.parametrize("taps", [3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_it_gives_mlx_conv1d_results(dtype, taps, padding):
    def work():
        import mlx.core as mx

        from vlmserve.engine.ops.depthwise_conv import depthwise_conv1d

        mx.random.seed(taps + padding)
        channels = 24
        x = mx.random.normal((3, 9, channels)).astype(getattr(mx, dtype))
        w = mx.random.normal((channels, taps, 1)).astype(getattr(mx, dtype))
        exact = mx.conv1d(x.astype(mx.float32), w.astype(mx.float32), padding=padding, groups=channels)
        mlx = mx.conv1d(x, w, padding=padding, groups=channels)
        ours = depthwise_conv1d(x, w, padding)
        assert ours.dtype == mlx.dtype and ours.shape == mlx.shape
        as_np = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        return as_np(exact), as_np(mlx), as_np(ours)

    exact, mlx, ours = on_own_thread(work)
    if dtype == "float32":
        np.testing.assert_allclose(ours, mlx, rtol=1e-5, atol=1e-5)
    else:  # one rounding of a float32 sum: no further from the exact sum than MLX's result
        assert np.abs(ours - exact).max() <= np.abs(mlx - exact).max() + 1e-6
        assert np.abs(ours - exact).max() <= 2**-7 * np.abs(exact).max()


def test_only_depthwise_convolutions_are_swapped_and_they_keep_their_outputs():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import depthwise_conv

        mx.random.seed(5)
        block = nn.Module()
        block.short = nn.Conv1d(16, 16, 3, groups=16, bias=True)  # depthwise: swapped
        block.dense = nn.Conv1d(16, 16, 3)  # every channel into every filter: kept
        block.strided = nn.Conv1d(16, 16, 3, stride=2, groups=16)  # kept
        x = mx.random.normal((2, 11, 16))
        block.short.bias = mx.random.normal((16,))
        before = [np.array(getattr(block, n)(x)) for n in ("short", "dense", "strided")]
        count = depthwise_conv.install(block, force=True)
        after = [np.array(getattr(block, n)(x)) for n in ("short", "dense", "strided")]
        kinds = [type(getattr(block, n)).__name__ for n in ("short", "dense", "strided")]
        names = sorted(name for name, _ in block.parameters()["short"].items())
        return count, kinds, before, after, names

    count, kinds, before, after, names = on_own_thread(work)
    assert count == 1 and kinds == ["PlanFreeDepthwiseConv1d", "Conv1d", "Conv1d"]
    assert names == ["bias", "weight"]  # the checkpoint's parameter names stay
    for b, a in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_off_cuda_nothing_is_swapped():
    def work():
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, depthwise_conv

        block = nn.Module()
        block.short = nn.Conv1d(8, 8, 3, groups=8)
        return cuda_kernels.on_cuda(), depthwise_conv.install(block)

    on_cuda, count = on_own_thread(work)
    assert count == (1 if on_cuda else 0)


def test_an_input_shorter_than_the_filter_is_refused_as_by_conv1d():
    def work():
        import mlx.core as mx

        from vlmserve.engine.ops.depthwise_conv import depthwise_conv1d

        x, w = mx.zeros((1, 2, 8)), mx.zeros((8, 4, 1))
        refused = []
        for conv in (lambda: mx.conv1d(x, w, groups=8), lambda: depthwise_conv1d(x, w)):
            try:
                mx.eval(conv())
            except ValueError:
                refused.append(True)
            else:
                refused.append(False)
        return refused

    assert on_own_thread(work) == [True, True]
