#!/usr/bin/env python3
"""Qwen2-VL tower calls at patch counts the process has not met: the first call against a
repeat of the same call, with the tower's rows rounded up to its row buckets (CUDA's default,
models/qwen2_vl/adapter.py TOWER_ROW_STEP, after the idle warm-up has run each bucket) and
with each call on its own rows. The gap between first and repeat is what a new count costs on
the request path (the matmuls' and the patch convolution's per-shape setup). Also checks that
the two ways give the same embeddings.

    python benchmarks/tower_rows.py MODEL_DIR [--calls 10] [--images 4]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from chat_requests import prepared_chats  # benchmarks/, the script's directory
from vlmserve.models.registry import load_model_adapter, model_type_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--images", type=int, default=4, help="images of random sizes per tower call")
    args = p.parse_args()
    model = load_model_adapter(args.model, model_type_of(args.model))
    if not getattr(model, "pads_tower_rows", False):
        raise SystemExit("this model's tower calls keep their rows here (Qwen2-VL on CUDA with vlmserve's kernels)")
    model.feature_cache = None  # every call runs the tower
    rng = np.random.default_rng(1)

    def requests():
        sizes = [(28 * int(rng.integers(8, 30)), 28 * int(rng.integers(8, 24))) for _ in range(args.images)]
        return prepared_chats(args.model, sizes, "What is it?", context=8192)

    def timed(reqs) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([s.embeds for s in model.embed_prompts(reqs)])
        mx.synchronize()
        return (time.perf_counter() - t0) * 1e3

    timed(requests())  # the tower's kernels
    t0, runs = time.perf_counter(), len(model.idle_warmups)
    while model.idle_warmups:
        model.warm_next_idle()
    print(f"idle warm-up: {runs} row buckets in {time.perf_counter() - t0:.2f} s")
    for label, padded in (("row buckets", True), ("own rows", False)):
        model.pads_tower_rows = padded
        firsts, repeats = [], []
        for _ in range(args.calls):
            reqs = requests()
            firsts.append(timed(reqs))
            repeats.append(timed(reqs))
        first, repeat = np.mean(firsts), np.mean(repeats)
        print(f"{label}: first calls {first:.1f} ms, repeats {repeat:.1f} ms (mean of {args.calls})")
    reqs = requests()
    own = np.array(model.embed_prompts(reqs)[0].embeds.astype(mx.float32))
    model.pads_tower_rows = True
    bucketed = np.array(model.embed_prompts(reqs)[0].embeds.astype(mx.float32))
    apart = np.abs(own - bucketed).max() / np.abs(own).max()
    print(f"embeddings apart: {apart:.1e} (largest difference over largest value)")


if __name__ == "__main__":
    main()
