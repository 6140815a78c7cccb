"""One decode step over the KV pool as the server runs it: the primitives of its graph (by kind,
per layer) and, compiled, the host's time to build and queue it against the time until the
device is done (the step's logits read back, as sampling reads them).

On CUDA a decode step is bound by the host's time per primitive (docs/benchmarks.md, "Host
time per decode step"); this measures what a change to the step's kernels buys.

    python benchmarks/decode_step.py MODEL_DIR [--rows 32 64] [--context 512] [--steps 50]
"""

from __future__ import annotations

import argparse
import collections
import io
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from host_timing import host_and_done_ms  # benchmarks/, the script's directory
from vlmserve.config import ServerConfig
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.decode_batch import make_decode_step
from vlmserve.models.registry import load_model_adapter, model_type_of

BLOCK_SIZE = ServerConfig.kv_block_size  # the server's default (--block-size)


def _blocks_per_row(context: int) -> int:
    return -(-(context + 1) // BLOCK_SIZE)


def _inputs(model, rows: int, context: int):
    """A step's inputs for `rows` rows, each `context` positions in: its own blocks of the pool."""
    per_row = _blocks_per_row(context)
    table = np.arange(1, rows * per_row + 1, dtype=np.int32).reshape(rows, per_row)
    write = table[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    positions = np.full(rows, context, np.int32)
    mrope = model.decode_positions([]) is not None
    return (
        mx.zeros((rows,), dtype=mx.int32),
        mx.array(positions) if mrope else None,
        mx.array(np.full(rows, context, np.int32)),
        mx.array(write.astype(np.int32)),
        mx.array(table),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    model = load_model_adapter(args.model, model_type_of(args.model))
    for check in getattr(model, "kernel_checks", []):  # the builds a server checks while idle
        check()
    layers, kv_shape, dtype = model.kv_layout()
    for rows in args.rows:
        pool = BlockPool(layers, kv_shape, dtype, BLOCK_SIZE, rows * _blocks_per_row(args.context) + 1)
        inputs = _inputs(model, rows, args.context)
        eager = make_decode_step(model.decode, BLOCK_SIZE, compiled=False)
        out = io.StringIO()
        mx.export_to_dot(out, *eager(*inputs, *pool.arrays()))
        counts = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()))
        total = sum(counts.values())
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(10))
        print(f"{rows} rows, context {args.context}: {total} primitives ({total / layers:.1f} a layer)\n    {top}")
        compiled = make_decode_step(model.decode, BLOCK_SIZE, compiled=True)

        def step(compiled=compiled, inputs=inputs, pool=pool):
            out = compiled(*inputs, *pool.arrays())
            pool.set_arrays(out[1:])
            return [mx.argmax(out[0], axis=-1), *out[1:]]

        for _ in range(3):  # trace and warm
            mx.eval(step())
        host, done = host_and_done_ms(step, args.steps)
        print(f"    compiled: host {host:.2f} ms, done {done:.2f} ms (median of {args.steps})")


if __name__ == "__main__":
    main()
