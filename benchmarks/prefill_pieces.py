"""Micro-benchmark: the next piece of several prompts prefilled one forward each, or together in
one forward (`prefill_pieces`), on one model. Reports host time (until the forward is queued)
and total time (until the device is done), per way and per row count.

    python benchmarks/prefill_pieces.py /root/models/qwen2-vl-2b-bf16 --rows 1 4 8 16 --piece 512 --before 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from host_timing import host_and_done_ms  # benchmarks/, the script's directory
from vlmserve.models.registry import load_model_adapter
from vlmserve.protocol import PreparedRequest


def _states(model, rows: int, before: int, piece: int):
    """`rows` text prompts, each with `before` positions already in its cache."""
    rng = np.random.default_rng(0)
    prepared = [
        PreparedRequest(prompt_ids=rng.integers(100, 5000, size=before + piece + 1).astype(np.int32))
        for _ in range(rows)
    ]
    states = model.embed_prompts(prepared)
    for st in states:
        if before:
            model.prefill(st, 0, before)
    mx.eval([c.state for st in states for c in st.cache])
    return states


def _ways(model, states, start: int, end: int) -> dict:
    """The two ways to prefill positions [start, end) of every state, each from the same caches."""
    snapshot = [[c.offset for c in st.cache] for st in states]

    def rewind():
        for st, offsets in zip(states, snapshot):
            for c, off in zip(st.cache, offsets):
                c.offset = off

    def alone():
        rewind()
        for st in states:
            model.prefill(st, start, end)
        return [c.state for st in states for c in st.cache]

    def together():
        rewind()
        model.prefill_pieces(states, [(start, end)] * len(states), 64)
        return [c.state for st in states for c in st.cache]

    return {"alone": alone, "together": together}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--piece", type=int, default=512)
    ap.add_argument("--before", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    model = load_model_adapter(args.model, config["model_type"], ())
    for rows in args.rows:
        states = _states(model, rows, args.before, args.piece)
        for name, fn in _ways(model, states, args.before, args.before + args.piece).items():
            host_and_done_ms(fn, 2)  # first runs build kernels
            host, total = host_and_done_ms(fn, args.repeat)
            print(json.dumps({"rows": rows, "way": name, "host_ms": round(host, 2), "total_ms": round(total, 2)}))


if __name__ == "__main__":
    main()
