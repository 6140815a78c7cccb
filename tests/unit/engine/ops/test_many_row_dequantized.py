"""many_row_dequantized: a quantized linear layer over many rows computes with its weight
dequantized (the same values as MLX's quantized matmul, up to summation order); over few rows it
is MLX's quantized matmul, bit for bit; it stays an nn.QuantizedLinear to every check."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread


def test_many_rows_dequantize_few_rows_stay_quantized():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import many_row_dequantized

        mx.random.seed(0)
        layer = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
        reference = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
        reference.update(layer.parameters())
        holder = nn.Sequential(layer)
        swapped = many_row_dequantized.install(holder)
        few = mx.random.normal((2, 8, 128))
        many = mx.random.normal((many_row_dequantized.MIN_ROWS, 128))
        weight = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=64, bits=4)
        return (
            swapped,
            isinstance(layer, nn.QuantizedLinear),
            np.array(layer(few)),
            np.array(reference(few)),
            np.array(layer(many)),
            np.array(many @ weight.T + layer["bias"]),
            np.array(reference(many)),
            many_row_dequantized.install(holder),
        )

    swapped, still_quantized, few, few_ref, many, many_dense, many_ref, again = on_own_thread(work)
    assert swapped == 1 and still_quantized and again == 0
    assert np.array_equal(few, few_ref)  # few rows: MLX's quantized matmul itself
    assert np.array_equal(many, many_dense)  # many rows: the dequantized weight's matmul
    np.testing.assert_allclose(many, many_ref, rtol=1e-4, atol=1e-4)  # the same values as quantized


def test_a_layer_of_one_group_a_row_takes_the_dequantized_weight_at_any_row_count():
    """Inputs as wide as a group: MLX's CUDA quantized matmul (0.32.4) is wrong there
    (benchmarks/qmm_one_group.py), so every call runs on the dequantized weight."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import many_row_dequantized

        mx.random.seed(0)
        one, two = (nn.QuantizedLinear(k, 96, bias=False, group_size=64, bits=4) for k in (64, 128))
        many_row_dequantized.install(nn.Sequential(one, two))
        weight = mx.dequantize(one["weight"], one["scales"], one["biases"], group_size=64, bits=4)
        dequantized, own = [], many_row_dequantized.dequantize
        many_row_dequantized.dequantize = lambda module: dequantized.append(module) or own(module)
        try:
            rows = [mx.random.normal((n, 64), key=mx.random.key(n)) for n in (1, 4, 20)]
            outs = [(np.array(one(x)), np.array(x @ weight.T)) for x in rows]
            two(mx.random.normal((4, 128)))  # two groups a row: MLX's quantized matmul
        finally:
            many_row_dequantized.dequantize = own
        return outs, [m is one for m in dequantized]

    outs, calls = on_own_thread(work)
    assert calls == [True] * 3
    for ours, dense in outs:
        assert np.array_equal(ours, dense)


def test_while_a_settings_kernels_are_built_its_calls_of_8_rows_or_more_run_dequantized():
    """many_row_dequantized.hold: a layer and a tied output embedding of a held (bits, group) run
    8 rows or more on the dequantized weight, fewer rows on MLX's quantized matmul; a setting not
    held takes the quantized matmul. Once released, the calls the built kernel takes (its dtype,
    128 outputs a tile) take the quantized matmul again; the others stay dequantized."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import many_row_dequantized

        mx.random.seed(1)
        layer = nn.QuantizedLinear(128, 256, bias=False, group_size=64, bits=4)
        odd = nn.QuantizedLinear(128, 96, bias=False, group_size=64, bits=4)  # 96 outputs: not the built kernel's
        embedding = nn.QuantizedEmbedding(128, 128, group_size=64, bits=4)
        references = {}
        for name, module in (("layer", layer), ("odd", odd)):
            references[name] = nn.QuantizedLinear(128, module["weight"].shape[0], bias=False, group_size=64, bits=4)
            references[name].update(module.parameters())
        tied = nn.QuantizedEmbedding(128, 128, group_size=64, bits=4)
        tied.update(embedding.parameters())
        assert many_row_dequantized.install(nn.Sequential(layer, odd, embedding)) == 3
        swapped = type(embedding).__name__

        def dense(module, x):
            w = mx.dequantize(module["weight"], module["scales"], module["biases"], group_size=64, bits=4)
            return np.array(x @ w.T)

        rows8, rows7 = mx.random.normal((1, 8, 128)), mx.random.normal((7, 128))
        out, dequantized, own = {}, [], many_row_dequantized.dequantize
        # On the CPU both paths give the same bits: count which one ran.
        many_row_dequantized.dequantize = lambda module: dequantized.append(module) or own(module)

        def calls(what):
            out[what] = [type(m).__name__ for m in dequantized]
            dequantized.clear()

        try:
            many_row_dequantized.hold({(8, 64)})
            out["other setting held"] = np.array(layer(rows8)), np.array(references["layer"](rows8))
            calls("other setting held: dequantized")
            many_row_dequantized.hold({(4, 64)})
            out["held, 8 rows"] = np.array(layer(rows8)), dense(layer, rows8)
            out["held, 7 rows"] = np.array(layer(rows7)), np.array(references["layer"](rows7))
            out["held, tied, 8 rows"] = np.array(embedding.as_linear(rows8)), dense(embedding, rows8)
            out["held, tied, 7 rows"] = np.array(embedding.as_linear(rows7)), np.array(tied.as_linear(rows7))
            calls("held: dequantized")
            many_row_dequantized.release((4, 64), mx.float32)
            out["released, 8 rows"] = np.array(layer(rows8)), np.array(references["layer"](rows8))
            out["released, tied, 8 rows"] = np.array(embedding.as_linear(rows8)), np.array(tied.as_linear(rows8))
            out["released, 96 outputs"] = np.array(odd(rows8)), dense(odd, rows8)
            out["released, another dtype"] = np.array(layer(b := rows8.astype(mx.float16))), dense(layer, b)
            calls("released: dequantized")
            out["still held"] = many_row_dequantized.held()
        finally:
            many_row_dequantized.dequantize = own
            many_row_dequantized.reset()
        return swapped, out

    swapped, out = on_own_thread(work)
    assert swapped == "ManyRowDequantizedEmbedding"
    assert out.pop("still held") == frozenset({(8, 64)})
    assert out.pop("other setting held: dequantized") == []
    assert out.pop("held: dequantized") == ["ManyRowDequantizedLinear", "ManyRowDequantizedEmbedding"]
    assert out.pop("released: dequantized") == ["ManyRowDequantizedLinear", "ManyRowDequantizedLinear"]
    got, expected = out.pop("released, another dtype")  # float16 against a float32 reference
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
    for what, (got, expected) in out.items():
        assert np.array_equal(got, expected), what


def test_a_prefetch_queues_the_dequantize_builds_the_layers_take(monkeypatch):
    """prefetch notes one build per setting of the swapped layers (bits, group, K, dtype), the
    very builds their calls over many rows take. The kernel is stood in for: any backend."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, kernel_disk_cache, many_row_dequantized

        noted, launched = [], set()

        class Recorder(kernel_disk_cache.CachedKernel):  # a kernel that files its builds
            def __init__(self):
                pass

            def note(self, *, inputs, output_dtypes, template, later=False):
                noted.append(tuple(template))

            def __call__(self, *, inputs, output_dtypes, template, output_shapes, **launch):
                launched.add(tuple(template))
                return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]

        monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
        monkeypatch.setattr(cuda_kernels, "kernel", lambda *args, **kwargs: Recorder())

        def quantized(n, k, bits):
            dense = nn.Linear(k, n, bias=False)
            dense.set_dtype(mx.bfloat16)
            return nn.QuantizedLinear.from_linear(dense, group_size=64, bits=bits)

        embedding = nn.Embedding(64, 128)
        embedding.set_dtype(mx.bfloat16)
        layers = [quantized(64, 128, 4), quantized(32, 128, 4), quantized(64, 256, 8)]
        layers.append(nn.QuantizedEmbedding.from_embedding(embedding, group_size=64, bits=4))
        model = nn.Sequential(*layers)
        many_row_dequantized.install(model)
        many_row_dequantized.prefetch(model)
        for layer in layers:
            many_row_dequantized.dequantize(layer)
        return noted, launched

    noted, launched = on_own_thread(work)
    assert len(noted) == 4 and set(noted) == launched and len(launched) == 2  # (4 bits, K 128) and (8, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_dequantize_kernel_gives_mlxs_weights(dtype):
    """4 and 8 bits, groups of 32, 64 and 128: scale * q + bias rounded once, as mx.dequantize."""

    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, many_row_dequantized

        if not cuda_kernels.enabled():
            return None
        out = []
        for bits in (4, 8):
            for group in (32, 64, 128):
                dense = nn.Linear(256, 48, bias=False)
                dense.set_dtype(getattr(mx, dtype))
                layer = nn.QuantizedLinear.from_linear(dense, group_size=group, bits=bits)
                assert many_row_dequantized._kernel_serves(layer)
                ours = many_row_dequantized.dequantize(layer)
                ref = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group, bits=bits)
                exact = mx.dequantize(
                    layer.weight,
                    layer.scales.astype(mx.float32),
                    layer.biases.astype(mx.float32),
                    group_size=group,
                    bits=bits,
                ).astype(ours.dtype)
                out.append(
                    (
                        (bits, group),
                        ours.dtype == ref.dtype,
                        *(np.array(a.astype(mx.float32)) for a in (ours, ref, exact)),
                    )
                )
        return out

    results = on_own_thread(work)
    if results is None:
        pytest.skip("the kernel runs on CUDA only")
    assert len(results) == 6
    for case, same_dtype, ours, ref, exact in results:
        assert same_dtype, case
        # float32, rounded once: equal but where a fused multiply-add rounds a tie the other way
        np.testing.assert_allclose(ours, exact, rtol=2**-7, atol=0, err_msg=str(case))
        np.testing.assert_allclose(ours, ref, rtol=1e-2, atol=1e-3, err_msg=str(case))
