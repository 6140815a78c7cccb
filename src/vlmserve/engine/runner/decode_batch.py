"""The running batch's KV caches, behind one interface the scheduler drives.

- `PagedDecodeBatch` (KV-cache families, and those whose other layers keep fixed-size state):
  the rows' KV lives in a paged pool (block_pool.py) and each row has a block table, and the
  state layers' state a row per slot beside it (row_states.py), so a decode step's shapes
  depend on the number of rows only, never on how long a context is: one compiled graph per
  row bucket.
- `PaddedDecodeBatch` (anything else, e.g. rotating or quantized caches): mlx_vlm's batch
  caches, left-padded, extended on join and filtered on leave.

`layout()` gives the row order of the next step: a list of the rows' owners (any object with
`cache_len` and `blocks`, and what the model adapter's `decode_positions` reads), `None` for
an empty row.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.models import cache as vlm_cache

from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
from vlmserve.engine.runner import host_arrays
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.row_states import RowStates, layer_kinds
from vlmserve.models import kv_caches

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
# Where attention gathers each row's KV densely (no kernel reads the pool: CPU, Metal), the
# gather's width is a shape: bucketed, so few shapes are traced.
WIDTH_BUCKETS = (256, 512, 1024, 2048, 4096)
# Where pools of two KV dtypes share the budget, the sizes a pool takes below its share are
# multiples of this fraction of the budget (DecodeBatches.size_step).
SIZE_STEPS = 16


def round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    step = buckets[-1]
    return -(-n // step) * step


def buckets_up_to(n: int, buckets: tuple[int, ...]) -> list[int]:
    """Every bucket a size of at most n can round up to."""
    return [b for b in buckets if b < n] + [round_up(n, buckets)]


def pages_kv(model) -> bool:
    """Whether this model decodes on the paged KV pool: its caches are plain KV, or plain KV and
    fixed-size state (kv_caches.pageable) where a step over the pool, and a shared pieces
    forward, give what the model's own caches give (a family's forward may read what mlx_vlm's
    caches have and the pool's views lack: it keeps its own caches, in one padded batch)."""
    caches = vlm_cache.make_prompt_cache(model.language_model)
    if not kv_caches.pageable(caches):
        return False
    if kv_caches.all_plain(caches):
        return True
    try:
        return _STATE_STEP_AGREES[model]
    except KeyError:
        _STATE_STEP_AGREES[model] = agrees = _state_step_agrees(model)  # once per model: a few forwards
        return agrees


_STATE_STEP_AGREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROBE_TOLERANCE = 0.02  # of the logits' largest magnitude: another batch's summation order, not another function
# A wide bfloat16 model's own two paths to one position's logits (its prompt prefilled whole, or
# all but its last token and then that token decoded) differ by more than that: 3-4% of the
# largest logit for a 1.6B hybrid model on CUDA, where the pool's step differed from its own by ~2%.
# The check allows NOISE_FACTOR times what the model's own paths differ by; another function
# (padding kept in a state, a mask misread) differs by the logits' own scale.
NOISE_FACTOR = 2.0
# ... but never more than this: own paths that differ by more are not rounding apart, and a
# bound derived from them would pass any step (a pool step without the rows' state is 40-130% off
# on the test checkpoints).
MAX_TOLERANCE = 0.1


def _state_step_agrees(model) -> bool:
    """A three-token prompt prefilled into its own caches, then one decode step through mlx_vlm's
    batch caches and one through the pool (the prompt joined as a prefilled row does): the same
    logits, to rounding. And where the model prefills pieces of several prompts in one
    right-padded forward, two prompts so (one padded) give the logits each gives alone: a state
    layer that kept the padding in its state would not."""
    layout = model.state_layout()
    layers, kv_shape, dtype = model.kv_layout()
    ids = (np.arange(3, dtype=np.int32) * 7 + 11) % model.info.vocab_size

    def prefilled():
        prompt = _embedded(model, ids)
        model.prefill(prompt, 0, len(ids) - 1)
        return types.SimpleNamespace(cache_len=len(ids) - 1, prompt=prompt, blocks=[], prefix_hit=None)

    token = mx.array(ids[-1:], dtype=mx.int32)
    stage = "prefilling a prompt to check the pool with"
    try:
        own = prefilled()
        positions = model.decode_positions([own])
        expected = model.decode(token, model.merge_caches([own.prompt.cache]), positions)
        whole = model.prefill(_embedded(model, ids), 0, len(ids))
        tolerance = probe_tolerance(_deviation(expected, whole))
        row = prefilled()
        stage = "a decode step over the paged KV pool"
        pool = BlockPool(layers, kv_shape, dtype, block_size=16, blocks=2)
        batch = PagedDecodeBatch(model, DecodeSteps(model, 16, False, layout), pool, 1 << 20, RowStates(layout, dtype))
        batch.join([row], model.merge_caches([row.prompt.cache]))
        logits = batch.forward(token, batch.layout())
        agrees = _deviation(logits, expected) <= tolerance
        if agrees and model.prefills_pieces:
            stage = "prefilling two prompts' pieces in one forward"
            agrees = _pieces_agree(model, [ids, np.concatenate([ids, ids[:2]])], tolerance)
    except Exception:  # noqa: BLE001 - its own batch caches serve it (PaddedDecodeBatch)
        log.warning("%s: %s failed; one padded batch serves it", model.info.model_type, stage, exc_info=True)
        return False
    if not agrees:
        log.warning(
            "%s: %s gave other logits than the model's own caches (past %.1f%% of the largest); "
            "one padded batch serves it",
            model.info.model_type,
            stage,
            100 * tolerance,
        )
    return agrees


def probe_tolerance(own: float) -> float:
    """The deviation the check allows where the model's own two paths differ by `own`, between
    the fixed tolerance and the ceiling (a NaN `own` allows the fixed one: NaN compares false)."""
    return min(MAX_TOLERANCE, max(PROBE_TOLERANCE, NOISE_FACTOR * own))


def _embedded(model, ids: np.ndarray):
    """A text prompt of these ids, embedded (its caches empty)."""
    from vlmserve.protocol import PreparedRequest

    return model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0]


def _deviation(logits: mx.array, expected: mx.array) -> float:
    """The largest difference, as a fraction of the expected logits' largest magnitude."""
    logits, expected = logits.astype(mx.float32).reshape(-1), expected.astype(mx.float32).reshape(-1)
    return (mx.abs(logits - expected).max() / mx.maximum(mx.abs(expected).max(), 1e-30)).item()


def _pieces_agree(model, prompts: list[np.ndarray], tolerance: float) -> bool:
    """Prompts of several lengths prefilled but for their last token in one right-padded pieces
    forward, then that token alone, give the logits each gives prefilled alone: their caches
    (their state) hold their own positions only (a forward that raises turns the pieces forward
    off itself: the pool still serves, as it then does rows one at a time)."""
    alone = [model.prefill(_embedded(model, ids), 0, len(ids)) for ids in prompts]
    states = [_embedded(model, ids) for ids in prompts]
    try:
        model.prefill_pieces(states, [(0, len(ids) - 1) for ids in prompts])
    except Exception:  # noqa: BLE001 - logged there, and pieces go one at a time from now on
        return True
    after = [model.prefill(state, len(ids) - 1, len(ids)) for state, ids in zip(states, prompts)]
    return all(_deviation(a, b) <= tolerance for a, b in zip(after, alone))


def make_decode_step(decode: Callable, block_size: int, compiled: bool, kinds: list[int] | None = None) -> Callable:
    """fn(tokens (S,), positions (S,) | None, lengths (S,), write (S,), table (S, W), *pools, *states)
    -> (logits (S, V), *new_pools, *new_states); eager, it also takes `probe`, a dict the layers'
    caches share (what the step learned: PagedLayerCache).

    `decode(tokens, caches, positions)` is the model's one-token batched forward (ModelAdapter.decode).
    `kinds` (row_states.layer_kinds; None: every layer KV): a layer's cache is a view of the pools,
    or one of its fixed-size state over `states` (a row per slot, RowStates). A pure function of
    its inputs, so `mx.compile` can trace it once per input shape."""

    def step(tokens, positions, lengths, write, table, *arrays, probe=None):
        layers = kinds if kinds is not None else [0] * (len(arrays) // 2)
        n = layers.count(0)
        kv, states = arrays[: 2 * n], list(arrays[2 * n :])
        shared = {} if probe is None else probe
        caches, k = [], 0
        for size in layers:
            if size == 0:
                caches.append(PagedLayerCache(kv[k], kv[n + k], lengths, write, table, block_size, shared))
                k += 1
            else:
                cache = vlm_cache.ArraysCache(size)
                cache.cache, states = states[:size], states[size:]
                caches.append(cache)
        logits = decode(tokens, caches, positions)
        paged = [c for c in caches if isinstance(c, PagedLayerCache)]
        state = [a for c in caches if not isinstance(c, PagedLayerCache) for a in c.cache]
        return (logits, *[c.keys for c in paged], *[c.values for c in paged], *state)

    if not compiled:
        return step
    with_pos = mx.compile(step)
    without_pos = mx.compile(lambda t, n, w, b, *kv: step(t, None, n, w, b, *kv))  # compiled inputs are arrays
    return lambda t, p, n, w, b, *kv: with_pos(t, p, n, w, b, *kv) if p is not None else without_pos(t, n, w, b, *kv)


class PaddedDecodeBatch:
    """Rows of a model whose caches the paged pool does not take (rotating windows, quantized
    KV) in mlx_vlm's own batch caches, left-padded to the longest row; the KV budget counts
    each row at that width, and its fixed state (GenericModel.row_memory; the runner's
    `_padded_width`), and a preempted row's caches go to host memory and come back by the same
    merge a joining row takes."""

    paged = False  # its KV is mlx_vlm's, outside the block pools

    def __init__(self, model):
        self.model = model
        self.rows: list[Any] = []
        self.cache: list[Any] | None = None

    def layout(self) -> list[Any]:
        return list(self.rows)

    def join(self, owners: list[Any], rows_cache: list[Any], rows: list[int] | None = None) -> None:
        """rows_cache: per-layer batch caches (from a prefill) holding `owners` in order (every row:
        its KV is outside the budget, so none is ever dropped at the join)."""
        if self.cache is None:
            self.cache = rows_cache
        else:
            for batch_layer, row_layer in zip(self.cache, rows_cache):
                batch_layer.extend(row_layer)
        self.rows.extend(owners)

    def remove(self, owners: list[Any]) -> None:
        keep = [i for i, r in enumerate(self.rows) if r not in owners]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        else:
            index = mx.array(keep, dtype=mx.int32)
            for layer in self.cache:
                layer.filter(index)

    def forward_pieces(self, tokens: mx.array, rows: list[Any]) -> list[tuple[int, int, mx.array]]:
        return [(0, len(rows), self.model.decode(tokens, self.cache, self.model.decode_positions(rows)))]

    def state_bytes(self) -> int:
        """0: its rows' state is in mlx_vlm's batch caches, counted as MLX's active memory only."""
        return 0

    def grow(self) -> None:
        """Nothing to place: each layer's batch cache grows its own buffers."""

    def evict(self, owner: Any) -> list:
        """Copy a row's caches to the host and take it out of the batch (preemption)."""
        host = self.host_row(self.cache, self.rows.index(owner))
        self.remove([owner])
        return host

    @staticmethod
    def host_row(rows_cache: list[Any], row: int, length: int = 0) -> list:
        """Row `row` of batch caches (the batch's, or a prefill's) copied to the host as `evict`
        gives a row out (each cache keeps its own length: `length` is not needed)."""
        states, metas = [], []
        for layer in rows_cache:
            if type(layer) is vlm_cache.ArraysCache:  # its extract fails on the state's empty slots
                states.append([None if a is None else a[row : row + 1] for a in layer.state])
                metas.append("")
            else:
                one = layer.extract(row)
                states.append(list(one.state))
                metas.append(one.meta_state)
        return list(zip(host_arrays.to_host(states), metas))

    def resume(self, owner: Any, host: list) -> None:
        """A preempted row comes back with the caches `evict` gave out, joining as a new row does."""
        caches = vlm_cache.make_prompt_cache(self.model.language_model)
        for cache, (state, meta) in zip(caches, host):
            arrays = host_arrays.from_host(state)
            cache.state = arrays if type(cache) is vlm_cache.ArraysCache else tuple(arrays)
            if meta:
                cache.meta_state = meta
        self.join([owner], self.model.merge_caches([caches]))


class PagedDecodeBatch:
    """Running rows of one KV dtype over that dtype's block pool. The runner decides how many
    blocks a row may hold (the KV budget); this places them in the pool and builds each
    step's block table."""

    paged = True

    def __init__(self, model, step: DecodeSteps, pool: BlockPool, context_length: int, states: RowStates | None = None):
        self.model = model
        self.step = step  # DecodeSteps: compiled where traced, eager elsewhere; shared across batches
        self.pool = pool
        self.context_length = context_length
        self.states = states  # the state layers' per-row state (None: every layer is KV)
        self.rows: list[Any] = []

    def layout(self) -> list[Any]:
        return list(self.rows)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def join(self, owners: list[Any], rows_cache: list[Any], rows: list[int] | None = None) -> None:
        """rows_cache: per-layer mlx_vlm BatchKVCache from a prefill, rows left-padded, ending
        together; `rows`: each owner's row there (default: in order). An owner whose prompt
        cache began with a cached prefix (`prefix_hit`) takes that prefix's full blocks as its
        first ones, shared, and writes only what follows. Every row's positions go into the pool
        with one gather and one scatter a layer (a copy per row and layer would be thousands of
        launches for a group of 32 prompts)."""
        kv_cache = kv_caches.kv_layers(rows_cache)
        end = kv_cache[0]._idx if kv_cache else 0
        batch_rows, cache_positions, slots = [], [], []  # per written position: its row, where it is, where it goes
        placed: list[tuple[int, int]] = []  # (slot, row in rows_cache) of each owner
        try:
            for i, owner in zip(rows or range(len(owners)), owners):
                n = owner.cache_len
                hit = getattr(owner, "prefix_hit", None)
                # Full blocks of positions < n, the owner's now (released with its others on a failure).
                owner.blocks = hit.take(self.pool) if hit is not None else []
                start = len(owner.blocks) * self.pool.block_size
                owner.blocks = self.pool.cover(owner.blocks, n + 1)
                if n > start:
                    batch_rows.append(np.full(n - start, i, np.int32))
                    cache_positions.append(np.arange(end - n + start, end, dtype=np.int32))
                    slots.append(self.pool.slots(owner.blocks, n)[start:])
                placed.append((self._place(owner), i))
            if slots:
                b, p = mx.array(np.concatenate(batch_rows)), mx.array(np.concatenate(cache_positions))
                # (B, heads, L, dim) seen as (B, L, heads, dim): each position's (heads, dim) at [row, position].
                layer_kv = [(c.keys.swapaxes(1, 2)[b, p], c.values.swapaxes(1, 2)[b, p]) for c in kv_cache]
                self.pool.write_at(mx.array(np.concatenate(slots)), layer_kv)
            if self.states is not None and placed:
                rows_state = kv_caches.state_layers(rows_cache)
                self.states.put([s for s, _ in placed], RowStates.of_rows(rows_state, [r for _, r in placed]))
        except BaseException:
            self._none_join(owners)
            raise

    def state_of(self, owner: Any) -> list[mx.array] | None:
        """A copy of a running row's state (one row per state array), as its next step reads it
        (None: every layer is KV). Lazy: a copy kept must be evaluated soon (`mx.async_eval`),
        as an unread gather keeps its whole input (every slot's state of this moment) alive."""
        if self.states is None:
            return None
        index = mx.array([self.rows.index(owner)], dtype=mx.int32)
        return [a[index] for a in self.states.arrays]  # a gather: the row's own copy, not a view

    def adopt(self, owners: list[Any]) -> None:
        """Rows whose prompts were prefilled into this pool (their `prefill_blocks`) join with
        those blocks, and the one their next position needs."""
        if any(owner.prefill_pool is not self.pool for owner in owners):
            raise RuntimeError("the KV pool its prompt was prefilled into is gone")
        try:
            slots = []
            for owner in owners:
                owner.blocks, owner.prefill_blocks, owner.prefill_pool = owner.prefill_blocks, [], None
                owner.blocks = self.pool.cover(owner.blocks, owner.cache_len + 1)
                slots.append(self._place(owner))
            if self.states is not None and owners:  # their state, from their own caches: a scatter an array
                own = [kv_caches.state_layers(owner.prompt.cache) for owner in owners]
                self.states.put(slots, [a for layer in zip(*own) for a in kv_caches.states_side_by_side(layer)])
        except BaseException:
            self._none_join(owners)
            raise

    def _none_join(self, owners: list[Any]) -> None:
        """A join that failed: none of them joins (the caller fails them); their blocks go back,
        placed or not."""
        self.remove(owners)
        for owner in owners:
            self.pool.release(owner.blocks)
            owner.blocks = []

    def resume(self, owner: Any, host: tuple[list, list]) -> None:
        """A preempted row comes back with the KV and state `evict` gave out (on a failure, its
        blocks go back)."""
        host_kv, host_states = host
        try:
            owner.blocks = self.pool.allocate(self.blocks_for(owner.cache_len + 1))
            self.pool.from_host(owner.blocks, host_kv, owner.cache_len)
            slot = self._place(owner)
            if self.states is not None:
                self.states.put([slot], host_arrays.from_host(host_states))
        except BaseException:
            self._none_join([owner])
            raise

    def evict(self, owner: Any) -> tuple[list, list]:
        """Copy a row's KV (and state) to the host and take it out of the batch (preemption)."""
        host_kv = self.pool.to_host(owner.blocks, owner.cache_len)
        states = self.states.to_host(self.rows.index(owner)) if self.states is not None else []
        self.remove([owner])
        return host_kv, states

    @staticmethod
    def host_row(rows_cache: list[Any], row: int, length: int) -> tuple[list, list]:
        """The last `length` positions of row `row` of a prefill's batch cache (rows left-padded,
        ending together, as `join` takes them), and its state layers' state, copied to the host
        as `evict` gives a row out: a prefilled row that steps aside before its join."""
        kv_cache = kv_caches.kv_layers(rows_cache)
        span = slice(kv_cache[0]._idx - length, kv_cache[0]._idx)
        kv = [[c.keys[row, :, span].swapaxes(0, 1), c.values[row, :, span].swapaxes(0, 1)] for c in kv_cache]
        states = RowStates.of_rows(kv_caches.state_layers(rows_cache), [row])
        return host_arrays.to_host(kv), host_arrays.to_host([states])[0]

    def grow(self) -> None:
        """Give each row the block its next position needs (the runner counted them in its budget)."""
        for row in self.rows:
            if row is not None and len(row.blocks) < self.blocks_for(row.cache_len + 1):
                row.blocks += self.pool.allocate(1)

    def _place(self, owner: Any) -> int:
        """Put `owner` in the first empty slot (more slots, a row bucket up, where none is); its slot."""
        if None not in self.rows:
            slots = len(self.rows)
            self.rows += [None] * (round_up(slots + 1, ROW_BUCKETS) - slots)
            if self.states is not None:
                self.states.reorder([*range(slots), *[None] * (len(self.rows) - slots)])
        slot = self.rows.index(None)
        self.rows[slot] = owner
        return slot

    def remove(self, owners: list[Any]) -> None:
        for owner in owners:
            if owner in self.rows:
                self.rows[self.rows.index(owner)] = None
                self.pool.release(owner.blocks)
                owner.blocks = []
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if not live:
            order = []
        elif round_up(len(live), ROW_BUCKETS) * 2 <= len(self.rows):  # mostly empty: fewer rows per step
            order = live + [None] * (round_up(len(live), ROW_BUCKETS) - len(live))
        else:
            return
        self.rows = [None if i is None else self.rows[i] for i in order]
        if self.states is not None:
            self.states.reorder(order)

    def forward(self, tokens: mx.array, rows: list[Any]) -> mx.array:
        """Logits (rows, V) of one step; `rows` is this step's `layout()`."""
        bs = self.pool.block_size
        live = [r for r in rows if r is not None]
        needed = self.blocks_for(max(r.cache_len for r in live) + 1)
        width = self.step.table_width(self.pool.dtype, needed, self.blocks_for(self.context_length), bs)
        table = np.zeros((len(rows), width), np.int32)
        write = np.zeros(len(rows), np.int32)  # empty rows write into block 0, which nobody reads
        lengths = np.zeros(len(rows), np.int32)
        for i, row in enumerate(rows):
            if row is not None:
                table[i, : len(row.blocks)] = row.blocks
                write[i] = row.blocks[row.cache_len // bs] * bs + row.cache_len % bs
                lengths[i] = row.cache_len
        pools = self.pool.arrays()
        states = self.states.arrays if self.states is not None else []
        out = self.step(
            tokens,
            self.model.decode_positions(rows),
            mx.array(lengths),
            mx.array(write),
            mx.array(table),
            *pools,
            *states,
        )
        self.pool.set_arrays(out[1 : 1 + len(pools)])
        if self.states is not None:
            self.states.arrays = list(out[1 + len(pools) :])
        return out[0]


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def kv_dtype(rows_cache: list[Any]):
    """The dtype of the KV a prefill produced (None for an empty one)."""
    kv = kv_caches.kv_layers(rows_cache)
    keys = getattr(kv[0], "keys", None) if kv else None
    return None if keys is None else keys.dtype


class DtypeGroupedBatch:
    """Paged batches by KV dtype: a row decodes in the dtype its prefill produced, as it would
    alone. Some prompts prefill in a wider dtype than the model's (float32 image embeddings in
    a bfloat16 model); one shared pool would widen every other row's attention with them.
    One dtype (the usual case) is one batch and one forward."""

    paged = True

    def __init__(self, make: Callable, model_dtype):
        self.make = make  # dtype -> PagedDecodeBatch
        self.model_dtype = model_dtype  # what a row with nothing cached yet decodes in
        self.groups: dict[Any, PagedDecodeBatch] = {}

    def layout(self) -> list[Any]:
        return [row for group in self.groups.values() for row in group.layout()]

    def _group(self, dtype) -> PagedDecodeBatch:
        if dtype not in self.groups:
            self.groups[dtype] = self.make(dtype)
        return self.groups[dtype]

    def join(self, owners: list[Any], rows_cache: list[Any], rows: list[int] | None = None) -> None:
        dtype = kv_dtype(rows_cache) or self.model_dtype
        for owner in owners:
            owner.kv_dtype = dtype
        try:
            self._group(dtype).join(owners, rows_cache, rows)
        finally:
            self._drop_empty()  # a join that failed may leave its new group empty

    def adopt(self, owners: list[Any]) -> None:
        """Rows prefilled into a pool (PagedDecodeBatch.adopt) join the batch of its dtype."""
        for owner in owners:
            owner.kv_dtype = owner.prefill_pool.dtype
        try:
            for dtype in {owner.kv_dtype for owner in owners}:
                self._group(dtype).adopt([owner for owner in owners if owner.kv_dtype == dtype])
        finally:
            self._drop_empty()

    def resume(self, owner: Any, host_kv: list) -> None:
        try:
            self._group(owner.kv_dtype).resume(owner, host_kv)
        finally:
            self._drop_empty()  # a resume that failed may leave its new group empty

    host_row = staticmethod(PagedDecodeBatch.host_row)

    @staticmethod
    def host_states(prompt_cache: list[Any]) -> list:
        """A prefilling row's state layers' state (its own caches), copied to the host as `evict`
        gives it out (none for a model whose layers are all KV)."""
        own = kv_caches.state_layers(prompt_cache)
        return host_arrays.to_host([RowStates.of_rows(own, [0])])[0] if own else []

    def state_of(self, owner: Any) -> list[mx.array] | None:
        return self.groups[owner.kv_dtype].state_of(owner)

    def pool_of(self, owner: Any) -> BlockPool:
        """The pool a running row's blocks are in."""
        return self.groups[owner.kv_dtype].pool

    def rows_in(self, pool: BlockPool) -> list[Any]:
        """The running rows whose blocks are in `pool`."""
        group = self.groups.get(pool.dtype)
        return [r for r in group.rows if r is not None] if group is not None and group.pool is pool else []

    def evict(self, owner: Any) -> list:
        host_kv = self.groups[owner.kv_dtype].evict(owner)
        self._drop_empty()
        return host_kv

    def grow(self) -> None:
        for group in self.groups.values():
            group.grow()

    def remove(self, owners: list[Any]) -> None:
        for group in self.groups.values():
            group.remove(owners)
        self._drop_empty()

    def _drop_empty(self) -> None:
        for dtype, group in list(self.groups.items()):
            if not group.rows:
                del self.groups[dtype]

    def state_bytes(self) -> int:
        """Bytes of the state layers' per-slot state (row_states.py) in every group."""
        return sum(a.nbytes for g in self.groups.values() if g.states is not None for a in g.states.arrays)

    def forward_pieces(self, tokens: mx.array, rows: list[Any]) -> list[tuple[int, int, mx.array]]:
        """[(start, end, logits of rows[start:end])], one piece per dtype group, in layout order."""
        pieces, start = [], 0
        for group in self.groups.values():
            end = start + len(group.rows)
            piece = tokens if len(self.groups) == 1 else tokens[start:end]
            pieces.append((start, end, group.forward(piece, rows[start:end])))
            start = end
        return pieces


class DecodeSteps:
    """The decode step at each shape (rows, table width, pool size, KV dtype): compiled where it
    has been traced, eager where it has not.

    A shape's first step runs eagerly (the same kernels, unfused: no trace); its second step
    traces the compiled step on the live arrays (tens of milliseconds, once, with no second
    pool) and every later one replays it. Warm-up traces the common shapes ahead.

    The first eager step also tells whether attention read the pool itself in every layer
    (the CUDA kernel). Then a step's table has one width for any context length, and the
    shapes depend on the row count only; elsewhere attention gathers the rows' KV and the
    width is bucketed to what the longest row needs (WIDTH_BUCKETS)."""

    def __init__(self, model, block_size: int, compiled: bool, state_layout: list[Any] | None = None):
        """`state_layout`: the model's (ModelAdapter.state_layout), where some layers keep state."""
        self.model = model
        self.block_size = block_size
        self.kinds = layer_kinds(state_layout) if state_layout is not None else None
        self.state_layout = state_layout
        self.eager = make_decode_step(model.decode, block_size, False, self.kinds)
        self.compiled = make_decode_step(model.decode, block_size, True, self.kinds) if compiled else None
        self.traced: set[tuple] = set()
        self.seen: set[tuple] = set()  # shapes that ran eagerly once
        self.reads_pool: dict[Any, bool] = {}  # KV dtype -> every layer's attention read the pool

    def table_width(self, dtype, needed: int, most: int, block_size: int) -> int:
        """Blocks per row in a step's table: `needed` holds the longest row, `most` the longest context."""
        if self.reads_pool.get(dtype):
            return max(needed, most)
        return -(-round_up(needed * block_size, WIDTH_BUCKETS) // block_size)

    def __call__(self, tokens: mx.array, positions, lengths: mx.array, write: mx.array, table: mx.array, *kv):
        shape = (tokens.shape[0], table.shape[1], kv[0].shape[0], kv[0].dtype)
        if self.compiled is not None and shape in self.traced:
            return self.compiled(tokens, positions, lengths, write, table, *kv)
        if self.compiled is None or shape not in self.seen:  # maybe a shape of one step
            self.seen.add(shape)
            probe: dict = {}
            out = self.eager(tokens, positions, lengths, write, table, *kv, probe=probe)
            layers = self.kinds.count(0) if self.kinds is not None else len(kv) // 2
            self.reads_pool.setdefault(kv[0].dtype, probe.get("kernel_layers", 0) == layers)
            return out
        t0 = time.perf_counter()
        try:
            out = self.compiled(tokens, positions, lengths, write, table, *kv)
        except Exception:  # noqa: BLE001 - MLX could not trace this model's step: it decodes eagerly
            # Seen on CUDA with one family's step (MLX's compile raised `IndexError: _Map_base::at`)
            # that runs eagerly: slower steps, not a server that cannot start.
            log.warning("compiling the decode step failed; the model decodes without compiling", exc_info=True)
            self.compiled = None
            return self.eager(tokens, positions, lengths, write, table, *kv)
        self.traced.add(shape)
        seconds = time.perf_counter() - t0
        log.info("compiled the decode step for %d rows x %d blocks in %.2f s", shape[0], shape[1], seconds)
        return out

    def retrace(self) -> None:
        """The model's kernels changed (a faster one now serves): every shape traces again on its
        next step, since a trace keeps the ops it was traced with."""
        if self.compiled is not None:
            self.compiled = make_decode_step(self.model.decode, self.block_size, True, self.kinds)
            self.traced.clear()

    def _warm_call(self, pool: BlockPool, rows: int, width: int):
        """The compiled step's outputs (unevaluated) at this shape, its writes going to block 0."""
        zeros = mx.zeros((rows,), dtype=mx.int32)
        table = mx.zeros((rows, width), dtype=mx.int32)
        states = RowStates(self.state_layout, pool.dtype).zeros(rows) if self.state_layout is not None else []
        return self.compiled(
            zeros, self.model.decode_positions([None] * rows), zeros, zeros, table, *pool.arrays(), *states
        )

    def note_builds(self, pool: BlockPool, rows: int, width: int) -> None:
        """Trace the compiled step at this shape without running it: the builds of vlmserve's
        kernels it launches are queued for the kernel cache (kernel_disk_cache), to compile side
        by side before `trace` runs it; MLX keeps the trace."""
        if (rows, width, pool.keys[0].shape[0], pool.dtype) not in self.traced:
            self._warm_call(pool, rows, width)

    def trace(self, pool: BlockPool, rows: int, width: int) -> bool:
        """Trace (and on CUDA build) the compiled step at this shape (warm-up) unless it already
        is; its writes go to block 0. Returns whether it traced."""
        shape = (rows, width, pool.keys[0].shape[0], pool.dtype)
        if shape in self.traced:
            return False
        out = self._warm_call(pool, rows, width)
        # The pool takes the step's outputs before they are evaluated, as a served step's does:
        # holding its inputs meanwhile would keep a second copy of every layer's KV.
        pool.set_arrays(out[1 : 1 + len(pool.arrays())])
        mx.eval(out)
        self.traced.add(shape)
        return True


class DecodeBatches:
    """Makes the running batch for this model, keeps its block pools, and pre-compiles its
    decode shapes."""

    def __init__(
        self,
        model,
        compiled: bool,
        block_size: int,
        context_length: int,
        initial_blocks: int,
        budget_blocks: Callable[[], int] = lambda: 1 << 40,
        weight: Callable[[Any], int] = lambda dtype: 1,
        reclaim: Callable[[BlockPool, int], None] | None = None,
        cached: Callable[[BlockPool], Counter] = lambda pool: Counter(),
        renumber: Callable[[BlockPool, dict[int, int]], None] = lambda pool, mapping: None,
        holders: Callable[[BlockPool], list[tuple[Any, str]]] = lambda pool: [],
    ):
        self.model = model
        self.paged = pages_kv(model)
        # Layers of fixed-size state beside the KV ones: their state is kept per row (RowStates).
        plain = kv_caches.all_plain(vlm_cache.make_prompt_cache(model.language_model))
        self.state_layout = model.state_layout() if self.paged and not plain else None
        self.compiled = compiled and self.paged
        self.block_size = block_size
        self.context_length = context_length
        self.initial_blocks = initial_blocks
        self.budget_blocks = budget_blocks  # the KV budget, in blocks of the model's dtype
        self.weight = weight  # KV dtype -> budget blocks one of its blocks costs
        self.reclaim = reclaim  # frees blocks cached prefixes hold in a pool (BlockPool.reclaim)
        self.cached = cached  # block -> cached prefixes holding it, in a pool
        self.renumber = renumber  # a pool was compacted: cached prefixes take its new block ids
        # (object, attribute) of every block list in a pool besides cached prefixes' (running
        # rows, prompts prefilling into it, prefix hits not joined yet): what a compaction renumbers
        self.holders = holders
        self.step = DecodeSteps(model, block_size, self.compiled, self.state_layout) if self.paged else None
        self.pools: dict[Any, BlockPool] = {}
        self.kv_dtypes: list = []  # every KV dtype a pool was made for since start, in order

    def pool(self, dtype) -> BlockPool:
        if dtype not in self.kv_dtypes:
            self.kv_dtypes.append(dtype)
        if dtype not in self.pools:
            layers, kv_shape, _ = self.model.kv_layout()
            blocks = min(self.initial_blocks, self.most_blocks(dtype))
            pool = BlockPool(layers, kv_shape, dtype, self.block_size, blocks, most=lambda: self.most_blocks(dtype))
            pool.make_room = self._make_room
            pool.size_step = lambda: self.size_step(dtype)
            if self.reclaim is not None:
                pool.reclaim = self.reclaim
            self.pools[dtype] = pool
        return self.pools[dtype]

    def most_blocks(self, dtype) -> int:
        """The most blocks the pool of `dtype` may hold (block 0 included): the budget less what
        the other dtypes' pools take, so that all pools together stay within one budget."""
        others = sum((p.num_blocks - 1) * self.weight(d) for d, p in self.pools.items() if d != dtype)
        return max(0, self.budget_blocks() - others) // self.weight(dtype) + 1

    def size_step(self, dtype) -> int:
        """Blocks between two sizes a pool of `dtype` takes where the budget caps it beside another
        pool (growing into what that one left, or shrinking for it): a sixteenth of what the
        budget holds of that dtype, so that few pool sizes (each a shape of the compiled decode
        step) come of it."""
        if len(self.pools) < 2:  # alone, a pool's share does not move: it grows to all of it
            return 1
        return max(1, self.budget_blocks() // self.weight(dtype) // SIZE_STEPS)

    def _make_room(self, pool: BlockPool, blocks: int) -> None:
        """`pool` needs `blocks` blocks, past its share: the other pools give up their free tail
        blocks, then the blocks their cached prefixes hold (a pool nothing holds any more goes),
        then the free blocks between their rows' (`_compact_running`)."""
        for evict in (False, True):
            for dtype, other in list(self.pools.items()):
                if pool.most >= blocks:
                    return
                if other is pool:
                    continue
                holders = self.holders(other)
                if evict and self.reclaim is not None:  # enough free blocks to compact away what is short
                    self.reclaim(other, self._short(pool, blocks, dtype) + len(holders))
                if other.used == 0:
                    del self.pools[dtype]
                    continue
                size = other.num_blocks
                other.trim()
                if evict and pool.most < blocks:  # the tail was not enough
                    self._compact_running(other, holders, other.num_blocks - self._short(pool, blocks, dtype))
                if other.num_blocks < size:
                    log.info("KV pool (%s) shrank from %d to %d blocks", _dtype_name(dtype), size, other.num_blocks)

    def _short(self, pool: BlockPool, blocks: int, dtype) -> int:
        """Blocks of `dtype` the other pools must give up for `pool` to hold `blocks` (its share
        unclamped: `most` is 2 at least)."""
        lacking = blocks - self.most_blocks(pool.dtype)
        return max(0, -(-lacking * self.weight(pool.dtype) // self.weight(dtype)))

    def _compact_running(self, pool: BlockPool, holders: list[tuple[Any, str]], size: int) -> bool:
        """Shrink `pool` towards `size` blocks while rows use it (BlockPool.compact), keeping a
        free block per holder (a row's next one) and renumbering the holders' block lists and
        the cached prefixes' blocks. A size it has had (a traced decode shape) is taken where
        one fits, else one of its size steps. Not done where the holds on a block do not add up
        to what the holders and cached prefixes hold: a holder it was not told of keeps its ids."""
        known = self.cached(pool) + Counter(b for obj, attr in holders for b in getattr(obj, attr))
        if any(pool.refs[b] != known[b] for b in range(1, pool.num_blocks)):
            return False
        least = pool.used + 1 + len(holders)
        had = [s for s in pool.sizes if least <= s <= size]
        step = pool.size_step()
        target = max(had) if had else max(size // step * step, -(-least // step) * step)
        before = pool.num_blocks
        mapping = pool.compact(target)
        for obj, attr in holders:
            setattr(obj, attr, [mapping[b] for b in getattr(obj, attr)])
        self.renumber(pool, mapping)
        return pool.num_blocks < before

    def new(self):
        if not self.paged:
            return PaddedDecodeBatch(self.model)

        def make(dtype):
            states = RowStates(self.state_layout, dtype) if self.state_layout is not None else None
            return PagedDecodeBatch(self.model, self.step, self.pool(dtype), self.context_length, states)

        return DtypeGroupedBatch(make, self.model.kv_layout()[2])

    def release(self) -> list[tuple[BlockPool, dict[int, int]]]:
        """Idle (no row runs): drop the pools nothing holds blocks of, and shrink the others to
        what cached prefixes hold; returns each shrunk pool with its block ids' renumbering."""
        shrunk = []
        for dtype, pool in list(self.pools.items()):
            if pool.used == 0:
                del self.pools[dtype]
            else:
                shrunk.append((pool, pool.compact()))
        return shrunk

    def pool_bytes(self) -> int:
        return sum(sum(a.nbytes for a in pool.arrays()) for pool in self.pools.values())

    def other_kv_dtypes(self) -> list:
        """The KV dtypes besides the model's that rows have decoded in (pools made since start)."""
        model_dtype = self.model.kv_layout()[2]
        return [dtype for dtype in self.kv_dtypes if dtype != model_dtype]

    def shapes_to_warm(self, max_rows: int, max_tokens: int, dtype=None) -> list[tuple[int, int]]:
        """(rows, table width) of the compiled step at every row bucket up to `max_rows` (and
        where attention gathers, every width up to `max_tokens`) on the pool of `dtype` (the model
        dtype's by default); other shapes are traced when they come (DecodeSteps)."""
        if not self.compiled:
            return []
        dtype = dtype if dtype is not None else self.model.kv_layout()[2]
        most = -(-self.context_length // self.block_size)
        widths = sorted(
            {
                self.step.table_width(dtype, -(-t // self.block_size), most, self.block_size)
                for t in buckets_up_to(max_tokens, WIDTH_BUCKETS)
            }
        )
        return [(n, w) for n in buckets_up_to(max_rows, ROW_BUCKETS) for w in widths]

    def retrace(self) -> None:
        """See DecodeSteps.retrace."""
        if self.step is not None:
            self.step.retrace()

    def note_builds(self, rows: int, width: int) -> None:
        """See DecodeSteps.note_builds (on the model dtype's pool)."""
        self.step.note_builds(self._model_pool(), rows, width)

    def warm_shape(self, rows: int, width: int, dtype=None) -> bool:
        """Trace the compiled step at this shape on the pool of `dtype` (the model dtype's by
        default), unless it already is."""
        return self.step.trace(self.pool(dtype) if dtype is not None else self._model_pool(), rows, width)

    def _model_pool(self) -> BlockPool:
        return self.pool(self.model.kv_layout()[2])
