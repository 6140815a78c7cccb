"""MLX's quantized matmul (4-bit, group 64, bf16) against the dequantized weight, at inputs of one
group a row and of several, a few rows to a few hundred; each call four times, with freed
buffers full of NaNs between. On CUDA with MLX 0.32.4 the one-group shapes (64 inputs) came out
wrong and differed from run to run (non-finite at times); two groups or more agreed to bf16
rounding. vlmserve sends such layers through the dequantized weight
(engine/ops/many_row_dequantized.py).

    python benchmarks/qmm_one_group.py
"""

import mlx.core as mx
import numpy as np

# (rows, inputs, outputs)
SHAPES = [(20, 64, 64), (20, 128, 64), (20, 64, 128), (20, 128, 256), (300, 64, 64), (20, 256, 96), (8, 64, 64)]


def main() -> None:
    for rows, k, n in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(1)).astype(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((rows, k), key=mx.random.key(2)).astype(mx.bfloat16)
        ref = np.array(x.astype(mx.float32) @ mx.dequantize(q, s, b, group_size=64, bits=4).astype(mx.float32).T)
        errors = []
        for _ in range(4):
            junk = mx.full((4096, 4096), float("nan"), dtype=mx.bfloat16)
            mx.eval(junk)
            del junk  # freed buffers hold NaNs: a kernel reading memory it never wrote shows it
            y = np.array(mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4).astype(mx.float32))
            errors.append(float(np.abs(y - ref).max()) if np.isfinite(y).all() else "non-finite")
        print(f"rows {rows}, inputs {k}, outputs {n}: max |y - ref| {errors} (|ref| up to {np.abs(ref).max():.1f})")


if __name__ == "__main__":
    main()
