"""few_row_linear keeps each layer's kernel launch per input dtype and shape: made once, never for
a setting not checked yet, never reused by a layer holding other weights, never a parameter.
The kernels are stood in for, so these run on any backend."""

from support.helpers import on_own_thread


def _stand_ins(monkeypatch, made: list):
    import mlx.core as mx

    from vlmserve.engine.ops import few_row_matmul, few_row_quantized

    monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
    monkeypatch.setattr(few_row_quantized, "_CHECKED", {})

    def reference(layer, x):
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)

    def prepare(layer, x, shape=None):
        made.append((id(layer), x.shape))
        return lambda x: reference(layer, x)  # the layer it was made for, as a real launch holds its arrays

    monkeypatch.setattr(few_row_quantized, "matmul", lambda layer, x, shape=None: reference(layer, x))
    monkeypatch.setattr(few_row_quantized, "prepare", prepare)
    return reference


def _layer(n=48, k=64):
    import mlx.core as mx
    import mlx.nn as nn

    dense = nn.Linear(k, n, bias=False)
    dense.set_dtype(mx.bfloat16)
    return nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)


def test_a_launch_is_made_once_per_input_shape_and_only_once_checked(monkeypatch):
    def work():
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from vlmserve.engine.ops import few_row_linear, few_row_quantized

        made = []
        reference = _stand_ins(monkeypatch, made)
        layer = _layer()
        names = [k for k, _ in tree_flatten(layer.parameters())]
        x4 = mx.ones((4, 1, 64), dtype=mx.bfloat16)
        x8 = mx.ones((8, 1, 64), dtype=mx.bfloat16)
        unchecked = few_row_linear.linear(layer, x4)  # MLX's matmul serves it meanwhile
        made_unchecked = len(made)
        few_row_quantized.verify(layer)
        outs = [few_row_linear.linear(layer, x) for x in (x4, x4, x8, x8, x4)]
        equal = all(bool(mx.array_equal(o, reference(layer, x)).item()) for o, x in zip(outs, (x4, x4, x8, x8, x4)))
        after = [k for k, _ in tree_flatten(layer.parameters())]
        return made_unchecked, [shape for _, shape in made], equal, unchecked.shape, names == after

    made_unchecked, shapes, equal, unchecked_shape, same_parameters = on_own_thread(work)
    assert made_unchecked == 0 and unchecked_shape == (4, 1, 48)
    assert shapes == [(4, 1, 64), (8, 1, 64)]  # once per shape, however often called
    assert equal and same_parameters


def test_a_copy_holding_other_weights_makes_its_own_launch(monkeypatch):
    def work():
        import copy

        import mlx.core as mx

        from vlmserve.engine.ops import few_row_linear, few_row_quantized

        made = []
        reference = _stand_ins(monkeypatch, made)
        layer = _layer()
        few_row_quantized.verify(layer)
        x = mx.ones((4, 1, 64), dtype=mx.bfloat16)
        few_row_linear.linear(layer, x)
        other = copy.copy(layer)  # shares the attribute where launches are kept
        other.update({k: v[:32] for k, v in layer.items()})  # a layer of 32 outputs
        few_row_quantized.verify(other)
        out_other = few_row_linear.linear(other, x)
        out_layer = few_row_linear.linear(layer, x)
        return (
            len(made),
            out_other.shape,
            out_layer.shape,
            bool(mx.array_equal(out_other, reference(other, x)).item()),
            bool(mx.array_equal(out_layer, reference(layer, x)).item()),
        )

    count, other_shape, layer_shape, other_equal, layer_equal = on_own_thread(work)
    assert other_shape == (4, 1, 32) and layer_shape == (4, 1, 48)
    assert other_equal and layer_equal
    assert count == 3  # the layer, its copy, the layer again (the copy's launch took the shared key)
