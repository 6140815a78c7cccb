"""Time the few-row matmul kernels against MLX's own matmuls on one layer shape at a time.

For each linear layer shape of a decode step (default: a Qwen2-VL-2B language model) and row
count, it prints µs per call for MLX (dense matmul; quantized_matmul at the given bits and
group) and for vlmserve's kernels (few_row_matmul, few_row_quantized), with the quantized
kernel also at other launch shapes, to choose `few_row_quantized.launch_shape`. Each call
takes the next of `--layers` copies of the weight, as a step reads each layer's once (one
weight called again and again would be served from L2). CUDA only.

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


def per_call_us(fn, calls: int, x, layers) -> float:
    """µs per call of fn(x, layer), the layers taken in turn."""
    mx.eval([fn(x, layer) for layer in layers])
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn(x, layers[i % len(layers)]) for i in range(calls)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--calls", type=int, default=280)
    parser.add_argument("--layers", type=int, default=28, help="copies of each weight, called in turn")
    args = parser.parse_args()
    alternatives = [(1, 16, 1), (1, 8, 1), (2, 8, 1), (4, 4, 1), (2, 4, 1), (4, 2, 1)]  # (F, WARPS, U)
    for name, n, k in QWEN2_VL_2B:
        copies = 1 if name == "logits" else args.layers
        denses, quants = [], []
        for _ in range(copies):
            dense = nn.Linear(k, n, bias=False)
            dense.set_dtype(mx.bfloat16)
            denses.append(dense)
            quants.append(nn.QuantizedLinear.from_linear(dense, group_size=args.group, bits=args.bits))
            mx.eval(dense.parameters(), quants[-1].parameters())
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
            line = {
                "mlx dense": per_call_us(lambda x, d: d(x), args.calls, x, denses),
                "ours dense": per_call_us(lambda x, d: few_row_matmul.matmul(x, d.weight), args.calls, x, denses),
                "mlx quant": per_call_us(lambda x, q: q(x), args.calls, x, quants),
                "ours quant": per_call_us(lambda x, q: few_row_quantized.matmul(q, x), args.calls, x, quants),
            }
            mt = few_row_matmul.row_tiles(rows)
            for f, warps, u in alternatives:
                if n % (16 * f) == 0:
                    shape = (mt, f, warps, u)
                    try:
                        run = lambda x, q, shape=shape: few_row_quantized.matmul(q, x, shape)  # noqa: E731
                        us = per_call_us(run, args.calls, x, quants)
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
