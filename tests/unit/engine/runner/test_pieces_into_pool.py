"""Rows that prefill in pieces straight into the block pool (runner/model_runner.py): a row that
ends before it joins gives its blocks back (how such rows group: test_pieces_forwards.py)."""

from __future__ import annotations

from types import SimpleNamespace

from support.helpers import on_own_thread
from vlmserve.engine.runner.model_runner import ModelRunner
from vlmserve.engine.sched.request import Sequence
from vlmserve.protocol import FinishReason


def _seq(prefilled: int = 0, prompt: int = 100) -> Sequence:
    events: list = []
    req = SimpleNamespace(arrival=1.0, cancelled=False, request_id="r", emit=events.append, events=events)
    return Sequence(req=req, sampler=None, text=None, prefilled=prefilled, embedded_len=prompt)


def test_a_row_that_ends_while_it_prefills_into_the_pool_gives_its_blocks_back():
    def run():
        import mlx.core as mx

        from vlmserve.engine.runner.block_pool import BlockPool

        pool = BlockPool(num_layers=1, kv_shape=(1, 4, 4), dtype=mx.float32, block_size=4, blocks=8)
        runner = ModelRunner.__new__(ModelRunner)  # finish's bookkeeping only
        seq = _seq()
        seq.prefill_pool, seq.prefill_blocks = pool, pool.allocate(3)
        held = pool.used
        runner.finish(seq, FinishReason.ABORT)
        return held, pool.used, seq.prefill_blocks, seq.prefill_pool, seq.req.events[0].finish_reason

    held, used, blocks, pool, reason = on_own_thread(run)
    assert (held, used, blocks, pool, reason) == (3, 0, [], None, FinishReason.ABORT)
