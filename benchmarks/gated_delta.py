"""The gated delta rule (Qwen3.5's linear attention) as mlx_vlm runs it on CUDA against vlmserve's
kernel (engine/ops/gated_delta_scan.py), per call, at rows x positions; and how far apart their
outputs are. Over two positions or more mlx_vlm runs its chunked scan; over one (a decode step)
its per-token ops, timed here as the decode step runs both, inside `mx.compile`. Timings are
each call evaluated alone, after one call at that shape.

    python benchmarks/gated_delta.py --shapes 1x2 1x512 1x4096 8x64 32x512 32x2 32x1 64x1 --heads 16 --dim 128

On an H200 (bf16, 16 heads of 128 x 128): 1x2 7.43 -> 0.05 ms, 1x512 8.17 -> 0.57 ms,
1x4096 22.1 -> 5.6 ms, 8x64 12.8 -> 0.29 ms, 32x512 16.6 -> 5.6 ms, 32x2 13.7 -> 0.13 ms.
"""

import argparse
import time

import mlx.core as mx
from mlx_vlm.models.qwen3_5 import gated_delta

from vlmserve.engine.ops import gated_delta_scan


def inputs(rows: int, length: int, heads: int, dim: int):
    """Unit-norm keys, queries scaled by 1/sqrt(dim), gates in (0.5, 1), as a layer gives them."""
    k = mx.random.normal((rows, length, heads, dim))
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(mx.bfloat16)
    q = (k * dim**-0.5).astype(mx.bfloat16)
    v = mx.random.normal((rows, length, heads, dim)).astype(mx.bfloat16)
    g = mx.random.uniform(0.5, 1.0, (rows, length, heads))
    beta = mx.random.uniform(0, 1, (rows, length, heads)).astype(mx.bfloat16)
    state = mx.zeros((rows, heads, dim, dim))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def timed_ms(fn, args, calls: int) -> float:
    mx.eval(fn(*args))
    mx.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        mx.eval(fn(*args))
    mx.synchronize()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["1x2", "1x512", "1x4096", "8x64", "32x512", "32x2", "32x1", "64x1"]
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not gated_delta_scan.serves(*inputs(1, 2, args.heads, args.dim)[:5]):
        raise SystemExit("the kernel does not run here (it needs MLX's CUDA backend)")
    chunked = getattr(gated_delta.gated_delta_chunked, "vlmserve_routed", gated_delta.gated_delta_chunked)
    ops = mx.compile(getattr(gated_delta.gated_delta_ops, "vlmserve_routed", gated_delta.gated_delta_ops))
    compiled_scan = mx.compile(gated_delta_scan.scan)
    for shape in args.shapes:
        rows, length = (int(n) for n in shape.split("x"))
        call = inputs(rows, length, args.heads, args.dim)
        prompt = ("chunked", chunked, gated_delta_scan.scan)
        name, reference, kernel = prompt if length > 1 else ("ops", ops, compiled_scan)
        ref_y, ref_state = reference(*call)
        y, state = kernel(*call)
        dy = float(mx.abs(y.astype(mx.float32) - ref_y.astype(mx.float32)).max())
        ds = float(mx.abs(state - ref_state).max() / mx.abs(ref_state).max())
        print(
            f"{rows:3d} x {length:5d}: {name} {timed_ms(reference, call, args.calls):8.3f} ms, "
            f"kernel {timed_ms(kernel, call, args.calls):7.3f} ms; "
            f"max |dy| {dy:.3g}, state {ds:.3g} of its largest entry"
        )


if __name__ == "__main__":
    main()
