"""Micro-benchmark: MLX's peak memory and time of one vision-tower call for N images of one size
(Qwen2-VL-shaped models: patches of 14 px, 2x2 merge), through vlmserve's adapter.

    python benchmarks/vision_memory.py /root/models/qwen2-vl-2b-bf16 --images 1 8 16 32 --side 448
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from vlmserve.models.registry import load_model_adapter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--images", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--side", type=int, default=448)
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    model = load_model_adapter(args.model, config["model_type"], ())
    tower = model.model.vision_tower
    dtype = tower.patch_embed.proj.weight.dtype
    grid_side = args.side // 14
    per_image = grid_side * grid_side
    channels = 3 * 2 * 14 * 14
    base = mx.get_active_memory()
    print(json.dumps({"weights_gb": round(base / 1e9, 2)}))
    for n in args.images:
        pixels = mx.random.normal((n * per_image, channels)).astype(dtype)
        grid = mx.array(np.tile([1, grid_side, grid_side], (n, 1)))
        mx.eval(pixels)
        for _ in range(2):  # the second run is the one measured (kernels built)
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            out = model._tower(pixels, np.asarray(grid)) if hasattr(model, "_tower") else tower(pixels, grid)
            mx.eval(out)
            seconds = time.perf_counter() - t0
        peak = mx.get_peak_memory() - mx.get_active_memory()
        result = {"images": n, "patches": n * per_image, "ms": round(seconds * 1e3, 1)}
        print(json.dumps({**result, "peak_above_gb": round(peak / 1e9, 2)}), flush=True)
        del out


if __name__ == "__main__":
    main()
