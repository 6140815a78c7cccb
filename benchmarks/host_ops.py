"""How many MLX primitives a vision-tower call, a multi-row prompt-piece forward (each row in
its own cache, and in the block pool as the server runs it) and a group of prompts joining the
pool queue, and what they cost the host against the device.

On CUDA these phases are bound by the host's time per primitive (docs/benchmarks.md, "Where
pass 1's extra time goes"). For each case: primitives in the lazy graph (by kind, the largest
counts), the host's time to build and queue it, and the time until the device is done.

    python benchmarks/host_ops.py MODEL_DIR [--sizes 448x448 1024x768 ...] [--rows 8]
"""

from __future__ import annotations

import argparse
import collections
import io
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from chat_requests import prepared_chats  # benchmarks/, the script's directory
from host_timing import host_and_done_ms
from vlmserve.config import ServerConfig
from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache, PiecesLayout
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.decode_batch import PagedDecodeBatch
from vlmserve.models.registry import load_model_adapter, model_type_of

BLOCK_SIZE = ServerConfig.kv_block_size  # the server's default (--block-size)
MIXED = ["224x224", "336x336", "448x448", "512x384", "640x480", "384x640", "768x768", "1024x768"]


def primitives(build) -> collections.Counter:
    """The primitives behind what `build()` returns, by name (what it queues itself included)."""
    queue, mx.async_eval = mx.async_eval, lambda *_: None
    try:
        arrays = build()
    finally:
        mx.async_eval = queue
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()))


def _requests(path: Path, sizes: list[str], words: int):
    """`sizes`: "WxH" for an image request, "text" for text alone; `words` of text each."""
    dims = [None if size == "text" else tuple(int(x) for x in size.split("x")) for size in sizes]
    return prepared_chats(path, dims, " ".join(["describe"] * words))


def _report(label: str, build, prepare=lambda: None, runs: int = 5) -> None:
    prepare()
    counts = primitives(build)
    host, done = host_and_done_ms(build, runs, prepare)
    top = ", ".join(f"{k} {v}" for k, v in counts.most_common(8))
    print(
        f"{label}: {sum(counts.values())} primitives; host {host:.1f} ms, "
        f"done {done:.1f} ms (median of {runs})\n    {top}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--sizes", nargs="+", default=["448x448", "1024x768", "224x224,640x480,768x768", ",".join(MIXED)])
    p.add_argument("--rows", type=int, default=8, help="rows of the prompt-piece forward")
    p.add_argument("--piece", type=int, default=256, help="positions each row prefills in it")
    p.add_argument("--join-rows", type=int, default=32, help="prompts of a group joining the pool")
    args = p.parse_args()
    model = load_model_adapter(args.model, model_type_of(args.model))
    for mix in args.sizes:
        sizes = mix.split(",")
        requests = _requests(args.model, sizes, 8)
        if getattr(model, "feature_cache", None) is not None:
            model.feature_cache = None  # every call runs the tower
        for _ in range(2):  # plans and kernels for these shapes, off the timing
            mx.eval([s.embeds for s in model.embed_prompts(requests)])
        while getattr(model, "attention_plans", None) is not None and model.attention_plans.pending():
            model.build_next_attention_plan()
        _report(f"embed {mix}", lambda requests=requests: [s.embeds for s in model.embed_prompts(requests)])

    requests = _requests(args.model, ["text"] * args.rows, 4 * args.piece)  # past the two pieces
    states = model.embed_prompts(requests)
    mx.eval([s.embeds for s in states])
    spans = [(args.piece, 2 * args.piece)] * args.rows  # the second piece: each row has a cache to continue

    def first_piece():
        for s in states:
            for c in s.cache:
                c.offset = 0
        model.prefill_pieces(states, [(0, args.piece)] * args.rows)
        mx.eval([c.state for s in states for c in s.cache])

    def second_piece():
        logits = model.prefill_pieces(states, spans)
        return [logits] + [c.state[0] for s in states for c in s.cache]

    first_piece()
    mx.eval(second_piece())
    label = f"pieces forward, {args.rows} rows x {args.piece} after {args.piece}"
    _report(f"{label}, each row's own cache", second_piece, first_piece)

    # The same forward as the runner runs it on a paged model: every row's KV in the block pool.
    layers, kv_shape, dtype = model.kv_layout()
    pool = BlockPool(layers, kv_shape, dtype, BLOCK_SIZE, blocks=args.rows * (-(-2 * args.piece // BLOCK_SIZE)) + 1)
    tables = [pool.allocate(-(-2 * args.piece // BLOCK_SIZE)) for _ in range(args.rows)]

    def pooled(span):
        layout = PiecesLayout(pool, tables, [span[0]] * args.rows, [span[1] - span[0]] * args.rows)
        caches = [PagedPiecesCache(layout, layer) for layer in range(layers)]
        return [model.prefill_pieces(states, [span] * args.rows, caches=caches), *pool.arrays()]

    def first_pooled_piece():
        mx.eval(pooled((0, args.piece)))

    first_pooled_piece()
    mx.eval(pooled(spans[0]))
    _report(f"{label}, in the block pool", lambda: pooled(spans[0]), first_pooled_piece)

    # Whole prompts prefilled together join the pool: their KV copied into their blocks.
    group = model.embed_prompts(_requests(args.model, ["text"] * args.join_rows, 300))
    ends = [int(s.embeds.shape[1]) - 1 for s in group]
    prefilled, _ = model.prefill_batch(group, ends, 1)
    mx.eval([c.state for c in prefilled])
    joining = {}

    def fresh_pool():
        joining["pool"] = BlockPool(layers, kv_shape, dtype, BLOCK_SIZE, blocks=sum(e // BLOCK_SIZE + 2 for e in ends))
        mx.eval(joining["pool"].arrays())

    def join():
        batch = PagedDecodeBatch(model, None, joining["pool"], context_length=max(ends) + 1)
        batch.join([SimpleNamespace(cache_len=n, prefix_hit=None, blocks=[]) for n in ends], prefilled)
        return joining["pool"].arrays()

    _report(f"join of {args.join_rows} prompts prefilled together", join, fresh_pool)


if __name__ == "__main__":
    main()
