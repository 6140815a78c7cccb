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


def _dense_stand_ins(monkeypatch, agrees: bool, made: list):
    import mlx.core as mx

    from vlmserve.engine.ops import few_row_matmul

    monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
    monkeypatch.setattr(few_row_matmul, "_CHECKED", {})

    def reference(x, w, b=None):
        y = x.astype(mx.float32) @ w.astype(mx.float32).T
        return (y if b is None else y + b.astype(mx.float32)).astype(x.dtype)

    def prepare(x, w, b=None, shape=None):
        made.append(x.shape)
        return lambda x: reference(x, w, b)

    monkeypatch.setattr(
        few_row_matmul, "matmul", lambda x, w, b=None, shape=None: reference(x, w, b) + (0 if agrees else 1)
    )
    monkeypatch.setattr(few_row_matmul, "prepare", prepare)
    return reference


def _dense(n, k=64, bias=False):
    import mlx.core as mx
    import mlx.nn as nn

    layer = nn.Linear(k, n, bias=bias)
    layer.set_dtype(mx.bfloat16)
    return layer


def test_a_dense_launch_past_32_rows_serves_only_once_its_build_is_checked(monkeypatch):
    """33 to 64 rows of a narrow dense layer take the kernel only after `check` passed its build
    (listed by `pending` once per build, for the idle time); until then, and where the check
    fails, the layer's own matmul serves. Wide layers never list such a build."""

    def work(agrees):
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import few_row_linear, few_row_matmul

        made = []
        reference = _dense_stand_ins(monkeypatch, agrees, made)
        model = nn.Sequential(_dense(48), _dense(48, bias=True), _dense(32), _dense(8192))
        narrow = model.layers[0]
        x = mx.random.normal((48, 1, 64), key=mx.random.key(0)).astype(mx.bfloat16)
        before = few_row_matmul.verdict(x, narrow.weight), few_row_linear.linear(narrow, x)
        todo = few_row_matmul.pending(model)
        for layer, rows in todo:
            few_row_matmul.check(layer, rows)
        after = few_row_matmul.verdict(x, narrow.weight), few_row_linear.linear(narrow, x)
        wide = few_row_matmul.verdict(mx.zeros((48, 1, 64), mx.bfloat16), model.layers[3].weight)
        equal = bool(mx.array_equal(after[1], reference(x, narrow.weight)).item())
        own = bool(mx.array_equal(before[1], narrow(x)).item())
        listed = [(id(layer), r) for layer, r in todo]
        return before[0], listed, [id(m) for m in model.layers], after[0], made, wide, equal, own

    before, todo, ids, after, made, wide, equal, own = on_own_thread(lambda: work(True))
    assert before is None and own  # unchecked: not served yet, the layer's matmul ran
    # One build per (K, dtype, bias, launch): the 48- and 32-wide layers without bias share theirs,
    # the one with bias has its own, the wide one none.
    assert len(todo) == 2 and {r for _, r in todo} == {64}
    assert {i for i, _ in todo} in ({ids[0], ids[1]}, {ids[2], ids[1]})
    assert after is True and made == [(48, 1, 64)] and equal  # checked: the launch serves
    assert wide is False
    refused = on_own_thread(lambda: work(False))
    assert refused[3] is False and refused[4] == []  # a build that disagrees is never served
