"""The KV budget of a model whose layers keep fixed-size state beside their KV (LFM2-VL,
Qwen3.5): the state of every decode slot a full batch takes comes off it before the blocks, so
the pool and the states together stay within it; a budget that cannot hold that says so at
start; and a model whose forward does not take the pool's views (it raises, or gives other
logits than its own caches) keeps one padded batch."""

from __future__ import annotations

import pytest

from support.families import session_checkpoint
from support.helpers import on_own_thread

pytestmark = pytest.mark.slow


def _model(family: str, tmp_path_factory):
    from vlmserve.models.registry import load_model_adapter

    path = session_checkpoint(family, "float32", tmp_path_factory)
    return lambda: load_model_adapter(path, family)


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_the_state_of_every_slot_and_of_cached_prefixes_comes_off_the_budget(family, tmp_path_factory):
    from vlmserve.config import ServerConfig
    from vlmserve.engine.core import EngineCore, kv_block_bytes, state_reserve_bytes
    from vlmserve.engine.runner.prefix_cache import STATE_SHARE

    load = _model(family, tmp_path_factory)

    def work():
        model = load()
        row = state_reserve_bytes(model, 1)
        block = kv_block_bytes(model, 32)

        def blocks(memory: int, cached_tokens: int = 0):
            config = ServerConfig(
                max_num_seqs=5, kv_cache_memory_gb=memory / (1 << 30), prefix_cache_tokens=cached_tokens
            )
            budget = EngineCore.kv_budget(model, config)
            return budget.total, budget.row_blocks

        plain = blocks(8 * row + 20 * block)
        # a prefix cache of 32 blocks' positions: its states may take a quarter of their KV's bytes
        with_cache = blocks(8 * row + 20 * block, 32 * 32)
        try:  # too little for five rows' state (eight slots) and a block
            blocks(8 * row)
        except ValueError as exc:
            refused = str(exc)
        else:
            refused = ""
        return row, state_reserve_bytes(model, 5), plain, with_cache, refused

    row, five, plain, with_cache, refused = on_own_thread(work)
    assert row > 0 and five == 8 * row  # five rows take the row bucket of eight slots
    assert plain == (20, 0)
    assert with_cache == (20 - int(STATE_SHARE * 32), 0)
    assert "--max-num-seqs" in refused and "--kv-cache-memory" in refused


@pytest.mark.parametrize("fault", ["raises", "differs", "pieces_keep_padding"])
def test_a_model_whose_step_fails_over_the_pool_keeps_one_padded_batch(fault, tmp_path_factory):
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
    from vlmserve.engine.runner.decode_batch import DecodeBatches, pages_kv

    load = _model("lfm2_vl", tmp_path_factory)

    def work():
        before = pages_kv(load())
        model = load()  # another: a model's answer is kept
        decode = model.decode

        def over_views(tokens, caches, positions):
            if any(isinstance(c, PagedLayerCache) for c in caches):
                if fault == "raises":  # a forward that reads what only mlx_vlm's caches have
                    raise AttributeError("'PagedLayerCache' object has no attribute 'left_padding'")
                for c in caches:  # one that runs, but without the rows' state
                    if not isinstance(c, PagedLayerCache):
                        c.cache = [None if a is None else mx.zeros_like(a) for a in c.cache]
            return decode(tokens, caches, positions)

        if fault == "pieces_keep_padding":  # state layers that take no piece lengths keep the padding
            caches = model._pieces_caches

            def without_lengths(states, lengths):
                made = caches(states, lengths)
                for cache in made:
                    if hasattr(cache, "write_back"):
                        cache.lengths = None
                return made

            model._pieces_caches = without_lengths
        else:
            model.decode = over_views
        batches = DecodeBatches(model, compiled=False, block_size=16, context_length=256, initial_blocks=8)
        return before, pages_kv(model), batches.paged, type(batches.new()).__name__

    before, after, paged, batch = on_own_thread(work)
    assert before and not after and not paged and batch == "PaddedDecodeBatch"


def test_a_model_whose_own_paths_differ_by_rounding_still_pages(tmp_path_factory):
    """The pool check allows the rounding the model's own caches show between two paths to one
    position (a wide bfloat16 model on CUDA: 3-4% of the largest logit), not just a fixed 2%."""
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
    from vlmserve.engine.runner.decode_batch import PROBE_TOLERANCE, pages_kv

    load = _model("lfm2_vl", tmp_path_factory)

    def work():
        model = load()
        decode = model.decode

        def rounded_off(tokens, caches, positions):  # the own caches' step: 1.5x the fixed tolerance off
            logits = decode(tokens, caches, positions)
            if any(isinstance(c, PagedLayerCache) for c in caches):
                return logits
            signs = mx.where(mx.arange(logits.shape[-1]) % 2 == 0, 1.0, -1.0).astype(logits.dtype)
            return logits + 1.5 * PROBE_TOLERANCE * mx.abs(logits).max() * signs

        model.decode = rounded_off
        return pages_kv(model)

    assert on_own_thread(work)


def test_own_paths_that_differ_past_rounding_do_not_loosen_the_check(tmp_path_factory):
    """A model whose own two paths to one position differ by far more than rounding (half the
    largest logit) cannot widen the check past its ceiling: a pool step without the rows' state
    still falls back to one padded batch."""
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
    from vlmserve.engine.runner.decode_batch import pages_kv

    load = _model("lfm2_vl", tmp_path_factory)

    def work():
        model = load()
        decode = model.decode

        def both_off(tokens, caches, positions):
            if any(isinstance(c, PagedLayerCache) for c in caches):  # the pool's step: no state
                for c in caches:
                    if not isinstance(c, PagedLayerCache):
                        c.cache = [None if a is None else mx.zeros_like(a) for a in c.cache]
                return decode(tokens, caches, positions)
            logits = decode(tokens, caches, positions)  # the own caches' step: another function
            signs = mx.where(mx.arange(logits.shape[-1]) % 2 == 0, 1.0, -1.0).astype(logits.dtype)
            return logits + 0.5 * mx.abs(logits).max() * signs

        model.decode = both_off
        return pages_kv(model)

    assert not on_own_thread(work)
