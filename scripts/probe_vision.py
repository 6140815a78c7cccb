#!/usr/bin/env python3
"""Time the vision tower as the server calls it (one call for all of a step's images), per image
count: the first call at each count (kernel builds, cuDNN plans) and the steady one.

    python scripts/probe_vision.py MODEL --counts 1,2,4,8,16,32,13,32 --size 448
    MLX_CUDA_USE_CUDNN_SDPA=0 python scripts/probe_vision.py MODEL ...   # without cuDNN attention
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from vlmserve.engine.model import VLM


def _tower_ms(vlm: VLM, pixels: mx.array, grid: np.ndarray, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(vlm._tower(pixels, grid))  # the server's tower call
        times.append((time.perf_counter() - t) * 1000)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--counts", default="1,2,4,8,16,32")
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (a multiple of 28)")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    vlm = VLM(Path(args.model))
    vc = vlm.model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    side = args.size // vc.patch_size
    dtype = vlm.model.vision_tower.patch_embed.proj.weight.dtype
    for n in [int(c) for c in args.counts.split(",")]:
        pixels = mx.random.normal((n * side * side, dim)).astype(dtype)
        grid = np.array([[1, side, side]] * n, dtype=np.int64)
        times = _tower_ms(vlm, pixels, grid, args.reps)
        steady = min(times[1:]) if len(times) > 1 else times[0]
        print(f"images={n:3d} first={times[0]:8.1f} ms  steady={steady:7.1f} ms  "
              f"per image={steady / n:5.2f} ms", flush=True)


if __name__ == "__main__":
    main()
