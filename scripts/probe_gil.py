#!/usr/bin/env python3
"""Time the compiled decode step while other threads run pure Python, at two GIL switch
intervals: how much a busy thread (event loop, preprocessing) slows the MLX thread.

    python scripts/probe_gil.py MODEL --batch 32
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import mlx.core as mx

from vlmserve.engine.model import VLM
from vlmserve.engine.slot_cache import SlotBatch, make_decode_step

from probe_fusion import time_steps  # scripts/ is on sys.path when this script runs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    a = p.parse_args()
    vlm = VLM(Path(a.model))
    kv0 = SlotBatch(*vlm.kv_layout(), slots=a.batch, capacity=512)
    step = make_decode_step(vlm.decode, True)
    tokens = mx.zeros((a.batch,), dtype=mx.int32)
    lengths = mx.full((a.batch,), 256, dtype=mx.int32)

    positions = lengths if vlm.uses_mrope else None

    def run(n: int) -> tuple[float, float]:
        ms, _, inside = time_steps(step, kv0, tokens, lengths, positions, n)
        return ms, inside

    def burn(stop: threading.Event) -> None:
        while not stop.is_set():
            pass

    for threads in (0, 1, 2):
        for interval in (0.005, 0.0005):
            sys.setswitchinterval(interval)
            run(8)
            stop = threading.Event()
            burners = [threading.Thread(target=burn, args=(stop,)) for _ in range(threads)]
            for t in burners:
                t.start()
            ms, inside = run(a.steps)
            stop.set()
            for t in burners:
                t.join()
            print(f"{threads} busy threads, switch {interval * 1000:.1f} ms: {ms:.2f} ms/step, "
                  f"inside async_eval {inside:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
