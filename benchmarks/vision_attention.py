"""Micro-benchmark: one vision-tower attention call (Qwen2-VL's tower heads, 16 x 80, bf16; others
with --heads / --dim, e.g. Qwen3-VL 8B's 16 x 72) per
image size and image count, through cuDNN (MLX's SDPA on CUDA: its first call builds the
plan, timed apart) and through the plan-free prompt attention kernel that serves a size until
its plan is built (engine/ops/prefill_attention.attend_unmasked), and through the same kernel
over all images' segments of one (S, 3, H, D) array at once (`attend_segments`, the route Qwen-VL
towers take), at each block layout given (query warps, key streams, key tile).

    python benchmarks/vision_attention.py --sizes 224x224 448x448 1024x768 --counts 1 2 4 --layouts 4,2,32 8,1,64
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import mlx.core as mx

from vlmserve.engine.ops import prefill_attention


def _patches(width: int, height: int, patch: int = 14, merge: int = 2) -> int:
    """Patches Qwen2-VL's processor makes of an image: each side rounded to patch * merge."""
    unit = patch * merge
    return (max(unit, round(width / unit) * unit) // patch) * (max(unit, round(height / unit) * unit) // patch)


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["224x224", "448x448", "640x480", "768x768", "1024x768"])
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=20)
    layouts = {prefill_attention.UNMASKED_LAYOUT, prefill_attention.LAYOUT}
    ap.add_argument("--layouts", nargs="+", default=[",".join(map(str, layout)) for layout in sorted(layouts)])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=80)
    args = ap.parse_args()
    heads, dim = args.heads, args.dim
    scale = dim**-0.5
    for size in args.sizes:
        width, height = (int(x) for x in size.split("x"))
        length = _patches(width, height)
        for count in args.counts:
            qkv = mx.random.normal((count * length, 3, heads, dim)).astype(mx.bfloat16)
            q, k, v = (qkv[:, i].reshape(count, length, heads, dim).transpose(0, 2, 1, 3) for i in range(3))
            mx.eval(q, k, v)

            def cudnn(q=q, k=k, v=v):
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)

            def plan_free(layout, q=q, k=k, v=v):
                return prefill_attention.attend_unmasked(q, k, v, scale, layout)

            qk = qkv[:, :2]
            bounds = mx.array([i * length for i in range(count + 1)], dtype=mx.int32)
            mx.eval(qk)

            def segments(layout, qk=qk, qkv=qkv, bounds=bounds, length=length):
                return prefill_attention.attend_segments(qk, qkv, bounds, length, scale, layout)

            first = _seconds(cudnn, 1)  # builds the plan
            flops = 4 * count * heads * length * length * dim
            row = {
                "size": size,
                "patches": length,
                "count": count,
                "cudnn_first_ms": round(first * 1e3, 2),
                "cudnn_ms": round(_seconds(cudnn, args.repeats) * 1e3, 3),
            }
            row["cudnn_tflops"] = round(flops / row["cudnn_ms"] / 1e9, 1)
            if prefill_attention.serves(mx.bfloat16, heads, heads, dim):
                for text in args.layouts:
                    layout = tuple(int(x) for x in text.split(","))
                    call = functools.partial(plan_free, layout)
                    _seconds(call, 1)  # its one build, for every shape
                    ms = _seconds(call, args.repeats) * 1e3
                    row[f"plan_free_ms[{text}]"] = round(ms, 3)
                    row[f"plan_free_tflops[{text}]"] = round(flops / ms / 1e9, 1)
                    ms = _seconds(functools.partial(segments, layout), args.repeats) * 1e3
                    row[f"segments_ms[{text}]"] = round(ms, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
