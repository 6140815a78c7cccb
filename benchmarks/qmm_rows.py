"""Micro-benchmark: a 4-bit (group 64, bf16 scales) linear layer at many rows, three ways: MLX's
quantized matmul, the weight dequantized then a bf16 matmul, and a bf16 weight (the reference).
Shapes are a 2B Qwen2-VL language model's (hidden 1536, MLP 8960).

    python benchmarks/qmm_rows.py --rows 64 256 512 2048 8192
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def _median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _row(n: int, k: int, rows: int, repeat: int) -> dict:
    """One layer shape at one row count, the three ways."""
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    mx.eval(x, wq, scales, biases, w)
    ways = {
        "qmm_ms": lambda: mx.quantized_matmul(x, wq, scales, biases, True, 64, 4),
        "dequant_ms": lambda: x @ mx.dequantize(wq, scales, biases, 64, 4).T,
        "bf16_ms": lambda: x @ w.T,
    }
    return {"n": n, "k": k, "rows": rows, **{name: round(_median_ms(fn, repeat), 3) for name, fn in ways.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512, 2048, 8192])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    for n, k in ((8960, 1536), (1536, 8960), (2048, 1536)):
        for rows in args.rows:
            print(json.dumps(_row(n, k, rows, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
