"""Micro-benchmark: the host's time per call of the decode step's few-row kernels against MLX's
own matmuls, at one layer shape and row count: building the graph (Python and MLX's call),
encoding it (`mx.async_eval`), and the whole chain of calls until the device is done. On CUDA
a decode step is bound by this host time, not by the device's.

    python benchmarks/few_row_host.py --shapes 17920x1536 2048x1536 --rows 32 64
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_linear, few_row_matmul, few_row_quantized


def _per_call_us(fn, calls: int) -> tuple[float, float, float]:
    for _ in range(3):
        mx.eval([fn() for _ in range(20)])
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn() for _ in range(calls)]
    t1 = time.perf_counter()
    mx.async_eval(outs)
    t2 = time.perf_counter()
    mx.eval(outs)
    t3 = time.perf_counter()
    return tuple(round(1e6 * t / calls, 1) for t in (t1 - t0, t2 - t1, t3 - t0))


def _ways(dense: nn.Linear, quantized: nn.QuantizedLinear, x: mx.array) -> dict:
    return {
        "ours, 4-bit": lambda: few_row_linear.linear(quantized, x),
        "ours, bf16": lambda: few_row_linear.linear(dense, x),
        "MLX, 4-bit": lambda: quantized(x),
        "MLX, bf16": lambda: x @ dense.weight.T,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["17920x1536", "2048x1536"], help="N x K of a layer")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        dense = nn.Linear(k, n, bias=False)
        dense.set_dtype(mx.bfloat16)
        quantized = nn.QuantizedLinear.from_linear(dense, 64, 4)
        mx.eval(dense.parameters(), quantized.parameters())
        for rows in args.rows:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            mx.eval(x)
            few_row_quantized.check(quantized, mx.bfloat16, min(rows, few_row_matmul.most_rows(n)))
            if rows > few_row_matmul.MAX_ROWS:  # the dense kernel's build past 32 rows serves once checked
                few_row_matmul.check(dense, min(rows, few_row_matmul.most_rows(n)))
            for name, fn in _ways(dense, quantized, x).items():
                build, encode, total = _per_call_us(fn, args.calls)
                print(f"{shape} rows={rows} {name:12s} build {build:6.1f}  encode {encode:6.1f}  total {total:6.1f} us")


if __name__ == "__main__":
    main()
