"""Micro-benchmark: a 4-bit (group 64, bf16 scales) linear layer at many rows, four ways: MLX's
quantized matmul, the weight dequantized (by `mx.dequantize`, and by vlmserve's kernel on CUDA)
then a bf16 matmul, and a bf16 weight (the reference); and the two dequantizations alone.
Shapes are a 2B Qwen2-VL language model's (hidden 1536, MLP 8960). Each figure is the median
time of `--chain` calls evaluated together, per call.

    python benchmarks/qmm_rows.py --rows 64 256 512 2048 8192
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import many_row_dequantized


def _median_ms(fn, repeat: int, chain: int) -> float:
    for _ in range(3):
        mx.eval([fn() for _ in range(chain)])
    times = []
    for _ in range(repeat):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(chain)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / chain)
    return sorted(times)[len(times) // 2] * 1e3


def _row(n: int, k: int, rows: int, repeat: int, chain: int) -> dict:
    """One layer shape at one row count, each way."""
    dense = nn.Linear(k, n, bias=False)
    dense.set_dtype(mx.bfloat16)
    layer = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    wq, scales, biases, w = layer.weight, layer.scales, layer.biases, dense.weight
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    mx.eval(x, layer.parameters(), w)
    ways = {
        "qmm_ms": lambda: mx.quantized_matmul(x, wq, scales, biases, True, 64, 4),
        "dequant_ms": lambda: x @ mx.dequantize(wq, scales, biases, 64, 4).T,
        "kernel_dequant_ms": lambda: x @ many_row_dequantized.dequantize(layer).T,
        "bf16_ms": lambda: x @ w.T,
        "dequantize_alone_ms": lambda: mx.dequantize(wq, scales, biases, 64, 4),
        "kernel_dequantize_alone_ms": lambda: many_row_dequantized.dequantize(layer),
    }
    times = {name: round(_median_ms(fn, repeat, chain), 3) for name, fn in ways.items()}
    return {"n": n, "k": k, "rows": rows, **times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512, 2048, 8192])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--chain", type=int, default=10)
    args = ap.parse_args()
    for n, k in ((17920, 1536), (1536, 8960), (2048, 1536), (1536, 1536)):
        for rows in args.rows:
            print(json.dumps(_row(n, k, rows, args.repeat, args.chain)), flush=True)


if __name__ == "__main__":
    main()
