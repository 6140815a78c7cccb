"""The few-row matmul kernels (engine/ops/few_row_matmul.py, few_row_quantized.py): on CUDA they
compute x @ W^T (+ bias) for dense and affine-quantized weights to float32 summation order, the
same on every call; elsewhere, and for shapes they do not take, `few_row_linear.linear` is the
layer's own call."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from support.helpers import on_own_thread


def test_linear_is_the_layers_call_where_the_kernel_does_not_serve():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, few_row_linear, few_row_matmul, few_row_quantized

        dense = nn.Linear(64, 48, bias=True)
        dense.set_dtype(mx.bfloat16)
        quantized = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)
        few_row_quantized.verify(quantized)  # on CUDA: checked, then served
        out = []
        for layer in (dense, quantized):
            for rows in (1, 4, 33):  # 1 row: never the kernel (MLX's gemv); 33: the quantized one only
                x = mx.random.normal((rows, 1, 64), key=mx.random.key(rows)).astype(mx.bfloat16)
                if layer is dense:
                    served = few_row_matmul.serves(x, layer.weight, layer.bias)
                else:
                    served = few_row_quantized.serves_layer(layer, x)
                out.append(
                    (
                        rows,
                        served,
                        np.array(few_row_linear.linear(layer, x).astype(mx.float32)),
                        np.array(layer(x).astype(mx.float32)),
                    )
                )
        return cuda_kernels.enabled(), out

    on_cuda, results = on_own_thread(work)
    assert len(results) == 6
    for i, (rows, served, ours, ref) in enumerate(results):
        # A narrow quantized layer's launch takes up to 64 rows once checked (few_row_matmul.most_rows);
        # a dense one's too, once its own check ran (not here: the dense layer keeps MLX's matmul).
        assert served == (on_cuda and (rows == 4 or (i >= 3 and rows == 33)))
        if served:
            np.testing.assert_allclose(ours, ref, atol=2e-2, rtol=2e-2)
        else:
            np.testing.assert_array_equal(ours, ref)


def test_launch_shapes_fit_every_served_shape():
    """Every served (rows, N, K) gets a grid that covers N exactly and a block within the
    48 KB of static shared memory its reduction declares."""
    import mlx.core as mx

    from vlmserve.engine.ops import few_row_quantized
    from vlmserve.engine.ops.few_row_matmul import MIN_ROWS, NARROW_MAX_ROWS, launch_shape, most_rows

    for m in range(MIN_ROWS, NARROW_MAX_ROWS + 1):
        x = mx.zeros((m, 1, 32))
        for n in (16, 48, 2048, 8192, 17920, 151936, 8208):
            if m > most_rows(n):
                continue
            for k in (32, 1536, 4096, 8960):
                for mt, f, warps, u in (launch_shape(m, n, k), few_row_quantized.launch_shape(x, n, k)):
                    assert mt * 8 >= m and n % (16 * f) == 0 and u >= 1 and warps * 32 <= 1024
                    assert u * mt <= 32  # the dense loop holds a 16-byte load per chunk in flight and tile
                    # Past 8 warps, more than one tile or chunk in flight asked too many registers.
                    assert warps <= 8 or (f, u) == (1, 1)
                    assert max(1, warps // 2) * f * mt * 4 * 32 * 4 <= 48 * 1024


def _outcome(case, run, x, n, ref):
    """(case, right shape and dtype, output, output again, reference) as NumPy (on the MLX thread)."""
    import mlx.core as mx

    ours, again = run(), run()
    shaped = ours.shape == x.shape[:-1] + (n,) and ours.dtype == x.dtype
    return case, shaped, *(np.array(a.astype(mx.float32)) for a in (ours, again, ref))


def _check(results, atol: float, relative_to_output: bool = False) -> None:
    """Each output has its shape, is the same on every call (a fixed summation order), and is
    within one rounding to bf16/fp16 of the float32 reference."""
    for case, shaped, ours, again, ref in results:
        assert shaped, case
        np.testing.assert_array_equal(ours, again, err_msg=str(case))
        scale = np.abs(ref).max() if relative_to_output else 1.0
        np.testing.assert_allclose(ours, ref, atol=atol * scale, rtol=atol, err_msg=str(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_matches_float32_matmul(dtype):
    """Narrow, wide (N >= 8192) and deep (K >= 4096) layers, with and without bias, at row
    counts that do and do not fill the 8-row tiles (eight tiles: narrow and deep layers only)."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, few_row_matmul

        if not cuda_kernels.enabled():
            return None
        t = getattr(mx, dtype)
        results = []
        for n, k in ((48, 64), (8192, 96), (32, 4096)):
            w = (mx.random.normal((n, k), key=mx.random.key(n)) * k**-0.5).astype(t)
            bias = (mx.random.normal((n,), key=mx.random.key(k)) * 0.1).astype(t)
            for rows in (2, 5, 8, 17, 32, 45, 64)[: 7 if n < few_row_matmul.WIDE else 5]:
                x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(t)
                for b in (None, bias):
                    if rows > few_row_matmul.MAX_ROWS:  # eight row tiles: served once checked
                        layer = nn.Linear(k, n, bias=b is not None)
                        layer.update({"weight": w, **({"bias": b} if b is not None else {})})
                        assert few_row_matmul.check(layer, rows)
                    assert few_row_matmul.serves(x, w, b)
                    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
                    if b is not None:
                        ref = ref + b.astype(mx.float32)
                    results.append(_outcome((rows, n, k), partial(few_row_matmul.matmul, x, w, b), x, n, ref))
        return results

    results = on_own_thread(work)
    if results is None:
        pytest.skip("the kernel runs on CUDA only")
    _check(results, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_kernel_matches_the_dequantized_float32_matmul(dtype):
    """4 and 8 bits, groups of 32, 64 and 128, narrow, wide and deep layers, with and without
    bias, one, four and (narrow and deep layers) eight 8-row tiles: against x @ dequantize(W).T
    in float32. (Not against MLX's
    own quantized_matmul: on the H100 with mlx-cuda 0.32.4 it disagreed with that reference
    for the (5, 1, 128) x (48, 128) case where this kernel agreed.)"""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, few_row_matmul, few_row_quantized

        if not cuda_kernels.enabled():
            return None
        t = getattr(mx, dtype)
        results = []
        # Every layer kind at the common setting; the other settings on a narrow layer (each
        # (setting, K, launch shape) is a kernel build of its own, ~2 s).
        layers = {(4, 64): ((48, 128, True), (8192, 256, False), (32, 4096, True))}
        for setting in ((4, 32), (4, 128), (8, 32), (8, 64)):
            layers[setting] = ((48, 128, True),)
        for (bits, group), shapes in layers.items():
            for n, k, with_bias in shapes:
                dense = nn.Linear(k, n, bias=with_bias)
                dense.set_dtype(t)
                layer = nn.QuantizedLinear.from_linear(dense, group_size=group, bits=bits)
                tiles = 3 if n < few_row_matmul.WIDE else 2
                assert few_row_quantized.verify(layer) == (tiles, 0)  # every tile count passes the self-check
                w = mx.dequantize(layer.weight, layer.scales, layer.biases, group, bits).astype(mx.float32)
                # 8-row tiles part filled (one tile; four; eight)
                for rows in (5, 32, 45)[:tiles]:
                    x = mx.random.normal((rows, 1, k), key=mx.random.key(rows + k)).astype(t)
                    assert few_row_quantized.serves_layer(layer, x)
                    ref = x.astype(mx.float32) @ w.T
                    if with_bias:
                        ref = ref + layer.bias.astype(mx.float32)
                    case = (bits, group, n, k, rows)
                    results.append(
                        _outcome(case, lambda x=x, layer=layer: few_row_quantized.matmul(layer, x), x, n, ref)
                    )
        return results

    results = on_own_thread(work)
    if results is None:
        pytest.skip("the kernel runs on CUDA only")
    assert len(results) == (3 + 4) * 3 - 1  # the wide layer takes no 45-row launch
    _check(results, atol=1e-2, relative_to_output=True)


@pytest.mark.parametrize("agrees", [True, False])
def test_a_quantized_setting_is_served_only_after_it_passed_its_check(monkeypatch, agrees):
    """verify() runs the kernel once per layer setting and tile count against the dequantized
    float32 matmul; a setting that disagrees (or fails to build) is left to MLX's matmul.
    The kernel is stood in for here, so this runs on any backend."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import few_row_matmul, few_row_quantized

        monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
        monkeypatch.setattr(few_row_quantized, "_CHECKED", {})

        def stand_in(layer, x, shape=None):
            w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
            y = (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)
            return y if agrees else y + 1

        monkeypatch.setattr(few_row_quantized, "matmul", stand_in)
        dense = nn.Linear(64, 48, bias=False)
        dense.set_dtype(mx.bfloat16)
        layer = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)
        x = mx.zeros((4, 1, 64), dtype=mx.bfloat16)
        before = few_row_quantized.serves_layer(layer, x)
        outcome = few_row_quantized.verify(layer), few_row_quantized.verify(layer)  # the second: no new checks
        return before, outcome, few_row_quantized.serves_layer(layer, x)

    before, (first, again), after = on_own_thread(work)
    assert before is False  # never served unchecked
    assert first == again == ((3, 0) if agrees else (0, 3))  # a narrow layer: 1, 4 and 8 row tiles
    assert after is agrees


def test_pending_lists_each_unchecked_setting_once_and_check_serves_it(monkeypatch):
    """Layers of one setting share one build and check: pending() names each setting and tile
    count once; a setting is served only once check() passed it. The kernel is stood in for."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import few_row_matmul, few_row_quantized

        monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
        monkeypatch.setattr(few_row_quantized, "_CHECKED", {})

        def stand_in(layer, x, shape=None):
            w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
            return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)

        monkeypatch.setattr(few_row_quantized, "matmul", stand_in)

        def quantized(n):
            dense = nn.Linear(64, n, bias=False)
            dense.set_dtype(mx.bfloat16)
            return nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)

        model = nn.Sequential(quantized(48), quantized(48), quantized(32))  # two settings
        todo = few_row_quantized.pending(model)
        x = mx.zeros((4, 1, 64), dtype=mx.bfloat16)
        served_before = few_row_quantized.serves_layer(model.layers[0], x)
        for item in todo:
            few_row_quantized.check(*item)
        return (
            len(todo),
            served_before,
            few_row_quantized.serves_layer(model.layers[1], x),
            few_row_quantized.pending(model),
        )

    count, before, after, left = on_own_thread(work)
    assert count == 2 * 3  # two (narrow) settings, three tile counts each
    assert before is False and after is True and left == []


def _launches_for(monkeypatch, n: int, rows: int, checked_rows=None):
    """The row counts of the kernel launches few_row_linear makes for a 4-bit (n x 64) layer over
    `rows` rows once the settings at `checked_rows` (all: None) are checked, whether the output
    equals the stand-in's answer over all rows at once, and its shape. The kernel is stood in
    for, so this runs on any backend."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import few_row_linear, few_row_matmul, few_row_quantized

        monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
        monkeypatch.setattr(few_row_quantized, "_CHECKED", {})
        calls = []

        def stand_in(layer, x, shape=None):
            calls.append(x.shape)
            w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
            return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)

        monkeypatch.setattr(few_row_quantized, "matmul", stand_in)
        monkeypatch.setattr(few_row_quantized, "prepare", lambda layer, x, shape=None: lambda x: stand_in(layer, x))
        dense = nn.Linear(64, n, bias=False)
        dense.set_dtype(mx.bfloat16)
        layer = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)
        for item in few_row_quantized.pending(layer):
            if checked_rows is None or item[2] in checked_rows:
                few_row_quantized.check(*item)
        calls.clear()
        x = mx.random.normal((rows, 1, 64), key=mx.random.key(rows)).astype(mx.bfloat16)
        ours = few_row_linear.linear(layer, x)
        ref = stand_in(layer, x)
        return [s[0] for s in calls[:-1]], ours.shape, bool(mx.array_equal(ours, ref).item())

    sizes, shape, equal = on_own_thread(work)
    assert shape == (rows, 1, n) and equal
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1  # even slices, in order
    return sizes


@pytest.mark.parametrize("rows", [33, 48, 64, 65, 100, 128])
def test_a_narrow_quantized_layer_takes_64_rows_a_launch(monkeypatch, rows):
    """A narrow layer's launch takes up to 64 rows (eight 8-row tiles); more run in even slices
    of 32 to 64."""
    sizes = _launches_for(monkeypatch, 48, rows)
    if rows <= 64:
        assert sizes == [rows]
    else:
        assert len(sizes) == -(-rows // 64) and all(32 <= s <= 64 for s in sizes)


@pytest.mark.parametrize("rows", [33, 48, 64, 128])
def test_a_wide_quantized_layer_runs_in_slices_of_at_most_32_rows(monkeypatch, rows):
    """A wide layer (8192 outputs or more) keeps launches of up to 32 rows, in even slices of 16 to 32."""
    sizes = _launches_for(monkeypatch, 8192, rows)
    assert len(sizes) == -(-rows // 32) and all(16 <= s <= 32 for s in sizes)


@pytest.mark.parametrize("rows", [48, 100])
def test_until_the_64_row_launch_is_checked_slices_of_32_serve(monkeypatch, rows):
    """Before its 64-row setting is checked (built while the server is idle), a narrow layer
    runs in slices of at most 32 rows: the launches already checked."""
    sizes = _launches_for(monkeypatch, 48, rows, checked_rows=(2, 32))
    assert len(sizes) == -(-rows // 32) and all(16 <= s <= 32 for s in sizes)


def test_the_quantized_kernel_takes_only_layers_its_loads_fit():
    """Each lane reads 8 bytes of a row (16 codes at 4 bits, 8 at 8 bits) and one scale and bias
    in the activations' dtype: K a multiple of 64 (4-bit) or 32 (8-bit), one dtype throughout."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import few_row_quantized

        def fits(k, bits, group, scales=mx.bfloat16, activations=mx.bfloat16):
            dense = nn.Linear(k, 32, bias=False)
            layer = nn.QuantizedLinear.from_linear(dense, group_size=group, bits=bits)
            layer.update({"scales": layer.scales.astype(scales), "biases": layer.biases.astype(scales)})
            return few_row_quantized._fits(layer, activations)

        return [
            fits(128, 4, 64),
            fits(128, 4, 32, mx.float16, mx.float16),
            fits(96, 8, 32),
            fits(96, 4, 32),  # 96 codes: not whole 64-input steps
            fits(128, 4, 64, mx.float16, mx.bfloat16),  # scales in another dtype
            fits(128, 4, 64, mx.float32, mx.float32),  # no tensor-core type
        ]

    assert on_own_thread(work) == [True, True, True, False, False, False]


def test_a_prefetch_queues_the_very_builds_the_checks_and_decode_launches_take(monkeypatch):
    """prefetch (at load) notes, for each pending check, the build its launch takes: the same
    kernel and template as the check's own launch and as a decode step's launch over that many
    rows of the whole layer (N is a launch size, not part of a build); prefetch_served notes the
    dense builds served without a check. The kernel is stood in for: any backend."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, few_row_matmul, few_row_quantized, kernel_disk_cache

        noted, launched, checked, served = set(), set(), [], []

        class Recorder(kernel_disk_cache.CachedKernel):  # a kernel that files its builds
            def __init__(self, name):
                self.name = name

            def note(self, *, inputs, output_dtypes, template, later=False):
                noted.add((self.name, tuple(x.dtype for x in inputs), tuple(template)))
                (checked if later else served).append(template)

            def __call__(self, *, inputs, output_dtypes, template, **launch):
                launched.add((self.name, tuple(x.dtype for x in inputs), tuple(template)))
                return [mx.zeros(launch["output_shapes"][0], dtype=output_dtypes[0])]

        monkeypatch.setattr(few_row_matmul, "enabled", lambda: True)
        monkeypatch.setattr(few_row_quantized, "_CHECKED", {})
        monkeypatch.setattr(few_row_matmul, "_CHECKED", {})
        monkeypatch.setattr(cuda_kernels, "kernel", lambda name, *args, **kwargs: Recorder(name))

        def layer(n, k, bits=None):
            dense = nn.Linear(k, n, bias=True)
            dense.set_dtype(mx.bfloat16)
            return dense if bits is None else nn.QuantizedLinear.from_linear(dense, group_size=64, bits=bits)

        model = nn.Sequential(layer(256, 512, bits=4), layer(256, 512, bits=8), layer(512, 256))
        quantized, dense = few_row_quantized.pending(model), few_row_matmul.pending(model)
        few_row_quantized.prefetch(quantized)
        few_row_matmul.prefetch(dense)
        few_row_matmul.prefetch_served(model)  # the dense layer's launches of up to 32 rows
        for item in quantized:  # each check's launch, and a decode launch over all features
            few_row_quantized._agrees(*item)
            lay, dtype, rows = item
            few_row_quantized.prepare(lay, x := mx.zeros((rows, 1, 512), dtype=dtype))(x)
        for lay, rows in dense:
            few_row_matmul._agrees(lay["weight"], lay["bias"], rows)
        lay = model.layers[2]
        for rows in (2, 5, 8, 9, 32, 64):  # every tile count a decode launch takes
            few_row_matmul.prepare(x := mx.zeros((rows, 1, 256), dtype=mx.bfloat16), lay["weight"], lay["bias"])(x)
        return noted, launched, len(quantized), len(dense), len(checked), len(served)

    noted, launched, quantized, dense, checked, served = on_own_thread(work)
    assert quantized == 2 * 3 and dense == 1  # two quantized settings at three tile counts, one narrow dense
    assert noted == launched and len(noted) == quantized + 3  # the dense layer at 1, 4 and 8 row tiles
    # The checks' builds (run after warm-up's generations) are filed after what decode serves unchecked.
    assert checked == quantized + dense and served == 2
