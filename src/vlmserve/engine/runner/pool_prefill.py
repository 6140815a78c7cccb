"""Rows whose prompts prefill in pieces straight into the paged KV pool (engine/ops/
paged_prefill_cache.py is the forward's view of it).

While it prefills in pieces, a row holds `prefill_blocks` of `prefill_pool`: its positions so
far, written there by each pieces forward; at its join the batch adopts them as they are. A
cached prefix it starts from is shared there from the moment it is embedded (`hit_in`), and KV
it already held in a cache of its own moves in at its first pieces forward (`move_in`). A path
that takes only a row's own cache (the single-prompt forward) fills it back from the pool
(`back_to_own_cache`), keeping the row's full blocks as a prefix hit for its join. The runner
(model_runner.py) decides when; this module keeps the blocks straight.

A model's layers of fixed-size state (convolution windows, recurrent state) keep it in the
row's own caches throughout (models/ragged_cache.py RaggedStateCache in the forward); only the
KV layers' positions go into the pool.
"""

from __future__ import annotations

import mlx.core as mx

from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache, PiecesLayout
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.prefix_cache import PooledKV, PrefixHit
from vlmserve.engine.sched.request import Sequence
from vlmserve.models import kv_caches
from vlmserve.models.ragged_cache import RaggedStateCache


def pieces_caches(pool: BlockPool, todo: list[tuple[Sequence, tuple[int, int]]]) -> list:
    """The layer caches of a pieces forward whose rows' KV lives in `pool`: each row's blocks
    (its prompt's KV so far moved in, the first time) then cover its piece; a state layer's
    is over the rows' own state (RaggedStateCache)."""
    for seq, (_, end) in todo:
        if seq.prefill_pool is None:
            move_in(seq, pool)
        seq.prefill_blocks = pool.cover(seq.prefill_blocks, end)
    lengths = [b - a for _, (a, b) in todo]
    layout = PiecesLayout(pool, [s.prefill_blocks for s, _ in todo], [a for _, (a, _) in todo], lengths)
    caches, k = [], 0
    for rows in zip(*(seq.prompt.cache for seq, _ in todo)):
        if kv_caches.is_state(rows[0]):
            caches.append(RaggedStateCache(list(rows), lengths))
        else:
            caches.append(PagedPiecesCache(layout, k))
            k += 1
    return caches


def move_in(seq: Sequence, pool: BlockPool) -> None:
    """A prefilling row's KV so far goes into `pool`: a cached prefix's full blocks shared, the
    rest copied from its own cache (kept until the forward that continues it is queued)."""
    hit, seq.prefix_hit = seq.prefix_hit, None
    blocks = hit.take(pool) if hit is not None else []
    seq.prefill_pool, seq.prefill_blocks = pool, blocks
    start, n = len(blocks) * pool.block_size, seq.prefilled
    if n > start:
        seq.prefill_blocks = pool.cover(blocks, n)
        layers = [
            (c.keys[0, :, start:n, :].swapaxes(0, 1), c.values[0, :, start:n, :].swapaxes(0, 1))
            for c in kv_caches.kv_layers(seq.prompt.cache)
        ]
        pool.write(seq.prefill_blocks, layers, n, start)


def hit_in(seq: Sequence, pool: BlockPool, kv: PooledKV, length: int) -> None:
    """A prompt whose pieces will go into `pool` starts from `length` positions of a cached
    prefix there: the prefix's full blocks become its first ones, shared, and the positions
    past them are copied into a block of its own (it writes on from `length`)."""
    bs = pool.block_size
    full = kv.blocks[: length // bs]
    start = len(full) * bs
    # Read before anything is allocated: an allocation may evict the entry and free its blocks.
    tail = pool.read_at(pool.positions(kv.blocks, length)[start:]) if length > start else []
    pool.retain(full)
    seq.prefill_pool, seq.prefill_blocks = pool, list(full)
    seq.prefilled = length
    if tail:
        seq.prefill_blocks = seq.prefill_blocks + pool.allocate(1)
        pool.write(seq.prefill_blocks, tail, length, start)


def back_to_own_cache(seq: Sequence) -> None:
    """A row prefilling into the pool goes on in its own (emptied) cache instead: a path that
    takes only such caches (its pieces' forward failed, or it goes alone). Its full blocks
    stay held as a prefix hit (shared with a cached prefix, maybe), which its join, or its
    next move into the pool, takes back instead of copying them."""
    pool, blocks = seq.prefill_pool, seq.prefill_blocks
    if seq.prefilled:
        own = kv_caches.kv_layers(seq.prompt.cache)
        pool.fill(own, blocks, seq.prefilled, seq.num_prompt)
        mx.async_eval([c.state for c in own])
    hit = PrefixHit.holding(pool, blocks, seq.prefilled)
    if hit.shared is not None:  # the row's hold on its full blocks passes to the hit
        seq.prefix_hit = hit
        seq.prefill_blocks = blocks[len(hit.shared.blocks) :]
    leave(seq)


def leave(seq: Sequence) -> None:
    """A prefilling row lets go of its blocks in the pool (it ends, or goes on in its own cache)."""
    if seq.prefill_pool is not None:
        seq.prefill_pool.release(seq.prefill_blocks)
    seq.prefill_pool, seq.prefill_blocks = None, []
