"""A decode shape's first step runs eagerly; its second traces the compiled step on the live
arrays (no second pool), and later steps replay it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from support.helpers import on_own_thread
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.decode_batch import DecodeSteps


class _Model:
    """Two layers of one KV head of width 4; the logits read the token and every cached key."""

    def kv_layout(self):
        return 2, (1, 4, 4), mx.float32

    def decode_positions(self, rows):
        return None

    def decode(self, tokens, caches, positions):
        new = mx.broadcast_to(tokens.astype(mx.float32)[:, None, None, None], (tokens.shape[0], 1, 1, 4))
        total = 0
        for cache in caches:
            keys, _ = cache.update_and_fetch(new, new)
            total = total + keys.sum(axis=(1, 2, 3))
        return mx.stack([total, tokens.astype(mx.float32)], axis=1)


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


BLOCK = 4


def _pool():
    return BlockPool(2, (1, 4, 4), mx.float32, BLOCK, blocks=16)


def _inputs(rows: int, width: int, pool=None):
    """Row r holds block r + 1 and writes its first position there."""
    pool = pool or _pool()
    tokens = mx.arange(1, rows + 1, dtype=mx.int32)
    lengths = mx.zeros((rows,), dtype=mx.int32)
    table = mx.array(np.arange(1, rows + 1, dtype=np.int32)[:, None] * np.ones((1, width), np.int32))
    write = mx.arange(1, rows + 1, dtype=mx.int32) * BLOCK
    return tokens, lengths, write, table, pool.arrays()


def test_new_shape_runs_eagerly_once_then_compiled():
    def work():
        steps = DecodeSteps(_Model(), BLOCK, compiled=True)
        steps.eager, steps.compiled = _Counting(steps.eager), _Counting(steps.compiled)
        tokens, lengths, write, table, kv = _inputs(4, 3)
        first = steps(tokens, None, lengths, write, table, *kv)
        assert (steps.eager.calls, steps.compiled.calls) == (1, 0)  # no trace in a shape's first step
        assert steps.traced == set()
        assert steps.reads_pool == {mx.float32: False}  # its attention gathered the rows' KV

        second = steps(tokens, None, lengths, write, table, *kv)
        assert (steps.eager.calls, steps.compiled.calls) == (1, 1)
        assert steps.traced == {(4, 3, 16 * BLOCK, mx.float32)}  # rows, table width, pool size, dtype
        third = steps(tokens, None, lengths, write, table, *kv)
        assert (steps.eager.calls, steps.compiled.calls) == (1, 2)
        for a, b, c in zip(first, second, third):
            np.testing.assert_allclose(np.array(a), np.array(b))
            np.testing.assert_allclose(np.array(a), np.array(c))

    on_own_thread(work)


def test_a_step_mlx_cannot_compile_runs_eagerly_from_then_on():
    def work():
        steps = DecodeSteps(_Model(), BLOCK, compiled=True)

        def fails(*args):
            raise IndexError("_Map_base::at")  # what MLX's compile raised for one model on CUDA

        steps.eager, steps.compiled = _Counting(steps.eager), _Counting(fails)
        tokens, lengths, write, table, kv = _inputs(4, 3)
        outs = [steps(tokens, None, lengths, write, table, *kv) for _ in range(3)]
        assert (steps.eager.calls, steps.traced) == (3, set()) and steps.compiled is None
        for a, b in zip(outs[0], outs[2]):
            np.testing.assert_allclose(np.array(a), np.array(b))
        steps.retrace()  # a kernel swap later does not bring the failing trace back
        assert steps.compiled is None

    on_own_thread(work)


def test_warm_up_traces_ahead_so_the_first_step_runs_compiled():
    def work():
        steps = DecodeSteps(_Model(), BLOCK, compiled=True)
        pool = _pool()
        steps.trace(pool, 4, 3)
        steps.eager, steps.compiled = _Counting(steps.eager), _Counting(steps.compiled)
        tokens, lengths, write, table, kv = _inputs(4, 3, pool)
        steps(tokens, None, lengths, write, table, *kv)
        assert (steps.eager.calls, steps.compiled.calls) == (0, 1)

    on_own_thread(work)


def test_without_compilation_every_step_runs_eagerly():
    def work():
        steps = DecodeSteps(_Model(), BLOCK, compiled=False)
        steps.eager = _Counting(steps.eager)
        tokens, lengths, write, table, kv = _inputs(2, 10)
        for _ in range(3):
            steps(tokens, None, lengths, write, table, *kv)
        assert steps.eager.calls == 3 and steps.traced == set()

    on_own_thread(work)


def test_retrace_drops_every_trace_so_shapes_trace_again_with_the_current_kernels():
    def work():
        steps = DecodeSteps(_Model(), BLOCK, compiled=True)
        pool = _pool()
        steps.trace(pool, 4, 3)
        old = steps.compiled
        steps.retrace()
        assert steps.traced == set() and steps.compiled is not old
        steps.eager, steps.compiled = _Counting(steps.eager), _Counting(steps.compiled)
        tokens, lengths, write, table, kv = _inputs(4, 3, pool)
        steps(tokens, None, lengths, write, table, *kv)
        steps(tokens, None, lengths, write, table, *kv)
        assert (steps.eager.calls, steps.compiled.calls) == (1, 1) and len(steps.traced) == 1

    on_own_thread(work)
