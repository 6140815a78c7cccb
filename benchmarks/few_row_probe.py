"""Time the few-row matmul kernels against MLX's own matmuls on one layer shape at a time.

For each linear layer shape of a decode step (default: a Qwen2-VL-2B language model) and row
count, it prints µs per call for MLX (dense matmul; quantized_matmul at the given bits and
group) and for vlmserve's kernels (few_row_matmul, few_row_quantized), with the quantized
kernel also at other launch shapes, to choose `few_row_quantized.launch_shape`. CUDA only.

    python benchmarks/few_row_probe.py --bits 4 --group 64 --rows 8,32
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul, few_row_quantized

# (name, N, K) of a Qwen2-VL-2B decode step: fused q/k/v, o, fused gate/up, down, tied logits.
QWEN2_VL_2B = (
    ("qkv", 2048, 1536),
    ("o", 1536, 1536),
    ("gate_up", 17920, 1536),
    ("down", 1536, 8960),
    ("logits", 151936, 1536),
)


def per_call_us(fn, calls: int, *args) -> float:
    mx.eval(fn(*args))
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    alternatives = [(1, 2, 4), (2, 8, 2), (1, 8, 4), (2, 16, 2), (4, 4, 1), (1, 16, 1)]  # (F, WARPS, U)
    for name, n, k in QWEN2_VL_2B:
        dense = nn.Linear(k, n, bias=False)
        dense.set_dtype(mx.bfloat16)
        q = nn.QuantizedLinear.from_linear(dense, group_size=args.group, bits=args.bits)
        mx.eval(dense.parameters(), q.parameters())
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
            line = {
                "mlx dense": per_call_us(dense, args.calls, x),
                "ours dense": per_call_us(few_row_matmul.matmul, args.calls, x, dense.weight),
                "mlx quant": per_call_us(q, args.calls, x),
                "ours quant": per_call_us(few_row_quantized.matmul, args.calls, q, x),
            }
            mt = 1 if rows <= 8 else 4
            for f, warps, u in alternatives:
                if n % (16 * f) == 0:
                    shape = (mt, f, warps, u)
                    try:
                        us = per_call_us(few_row_quantized.matmul, args.calls, q, x, shape)
                    except Exception as exc:  # noqa: BLE001 - a launch shape this GPU refuses
                        us = float("nan")
                        print(f"  {name} {shape}: {exc}")
                    line[f"F{f}W{warps}U{u}"] = us
            chosen = few_row_quantized.launch_shape(x, n, k)
            print(
                f"{name:8s} N={n:6d} K={k:5d} rows={rows:2d} chosen={chosen} "
                + " ".join(f"{key}={us:.1f}" for key, us in line.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
