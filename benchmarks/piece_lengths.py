"""Micro-benchmark: what a prompt piece costs the first, second and third time its shape runs.

For each (cached, new) pair, a text prompt with `cached` positions already in its cache prefills
its next `new` positions three times over the same cache (each time from the same offset), by
the pieces forward (`prefill_pieces`, lengths padded to `--bucket`) and by the single-prompt
forward (`prefill`, exact lengths). On CUDA the first runs of a shape pay for what is built per
shape (CUDA graphs unless MLX_USE_CUDA_GRAPHS=0, the matmuls' algorithm choice and kernel
loading); a pair whose padded length ran before shows what is left per new context width.

    python benchmarks/piece_lengths.py /root/models/qwen2-vl-2b-bf16 --pairs 512:5 512:165 1024:165
    MLX_USE_CUDA_GRAPHS=0 python benchmarks/piece_lengths.py /root/models/qwen2-vl-2b-bf16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from vlmserve.models.registry import load_model_adapter
from vlmserve.protocol import PreparedRequest

PAIRS = ["512:5", "512:16", "512:48", "512:165", "1024:165", "1024:5", "512:235", "1536:235", "512:443", "2048:443"]


def _timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    return round((time.perf_counter() - t0) * 1e3, 2)


def _runs(model, cached: int, new: int, way: str, bucket: int) -> dict:
    rng = np.random.default_rng(cached * 7919 + new)
    ids = rng.integers(100, 5000, size=cached + new + 1).astype(np.int32)
    state = model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0]
    if cached:
        model.prefill(state, 0, cached)
    mx.eval([c.state for c in state.cache])
    offsets = [c.offset for c in state.cache]

    def piece():
        for c, offset in zip(state.cache, offsets):
            c.offset = offset
        if way == "pieces":
            model.prefill_pieces([state], [(cached, cached + new)], bucket)
        else:
            model.prefill(state, cached, cached + new)
        return [c.state for c in state.cache]

    times = [_timed(piece) for _ in range(3)]
    return {"cached": cached, "new": new, "way": way, "first_ms": times[0], "second_ms": times[1], "third_ms": times[2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--pairs", nargs="+", default=PAIRS, help="cached:new position counts, in the order run")
    ap.add_argument("--bucket", type=int, default=64, help="the pieces forward's length multiple (--prefill-bucket)")
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    model = load_model_adapter(args.model, config["model_type"], ())
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs]
    warm = min(c for c, _ in pairs) or 1  # the kernels every shape shares, built before any pair
    for way in ("pieces", "single"):
        _runs(model, warm, warm, way, args.bucket)
    for cached, new in pairs:
        for way in ("pieces", "single"):
            print(json.dumps(_runs(model, cached, new, way, args.bucket)), flush=True)


if __name__ == "__main__":
    main()
