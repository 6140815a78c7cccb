"""RowStates (engine/runner/row_states.py): the state layers' state a row per decode slot, moved
with its row when the slots are compacted or grow, written at a join, read at an eviction."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def _states(slots: int):
    """A layout of one KV layer and two state layers (one array, then two), `slots` rows each, row i
    of every array filled with i + 1."""
    import mlx.core as mx

    from vlmserve.engine.runner.row_states import RowStates, layer_kinds

    layout = [None, [((2, 3), mx.float32)], [((4,), mx.bfloat16), ((1, 2), mx.float32)]]
    states = RowStates(layout)
    assert layer_kinds(layout) == [0, 1, 2]
    states.reorder(list(range(slots)))  # from no slots: zeros
    rows = [mx.arange(1, slots + 1).reshape(-1, *[1] * len(shape)) for shape, _ in states.specs]
    states.put(
        list(range(slots)),
        [mx.broadcast_to(r, (slots, *shape)).astype(dtype) for r, (shape, dtype) in zip(rows, states.specs)],
    )
    return states


def test_slots_move_with_their_rows_and_new_ones_are_zero():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner import host_arrays

        states = _states(4)
        out = {"start": [np.array(a.astype(mx.float32)).reshape(4, -1)[:, 0].tolist() for a in states.arrays]}
        states.reorder([0, 1, 2, 3, None, None, None, None])  # more slots
        out["grown"] = [np.array(a.astype(mx.float32)).reshape(8, -1)[:, 0].tolist() for a in states.arrays]
        states.reorder([3, 1])  # compacted: slot 0 takes slot 3's row
        out["compacted"] = [np.array(a.astype(mx.float32)).reshape(2, -1)[:, 0].tolist() for a in states.arrays]
        out["taken"] = [float(np.array(a.astype(mx.float32)).reshape(-1)[0]) for a in states.take(0)]
        host = states.to_host(1)
        states.reorder([])  # no row left
        out["empty"] = states.arrays
        states.reorder([None, None])  # rows again: empty slots
        states.put([1], host_arrays.from_host(host))
        out["back"] = [np.array(a.astype(mx.float32)).reshape(2, -1)[:, 0].tolist() for a in states.arrays]
        out["dtypes"] = [a.dtype for a in states.arrays]
        return out

    out = on_own_thread(work)
    assert out["start"] == [[1, 2, 3, 4]] * 3
    assert out["grown"] == [[1, 2, 3, 4, 0, 0, 0, 0]] * 3
    assert out["compacted"] == [[4, 2]] * 3 and out["taken"] == [4, 4, 4]
    assert out["empty"] == [] and out["back"] == [[0, 2]] * 3
    assert [str(d) for d in out["dtypes"]] == ["mlx.core.float32", "mlx.core.bfloat16", "mlx.core.float32"]


def test_a_wider_groups_states_are_as_wide_as_its_kv():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.row_states import RowStates

        layout = [[((4,), mx.bfloat16)]]
        narrow, wide = RowStates(layout), RowStates(layout, mx.float32)
        narrow.reorder([None])
        narrow.put([0], [mx.ones((1, 4), mx.float32)])  # a wider row's state widens the array
        return narrow.arrays[0].dtype, wide.zeros(2)[0].dtype, RowStates(layout, mx.float16).zeros(1)[0].dtype

    widened, wide, same = on_own_thread(work)
    assert str(widened) == str(wide) == "mlx.core.float32" and str(same) == "mlx.core.bfloat16"
