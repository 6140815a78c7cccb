"""The fixed-size state of the layers whose caches are not KV (a convolution window, a recurrent
state, in hybrid attention/convolution or attention/linear-attention models), kept per row
beside the paged KV pool.

Each state array has a row per slot of the paged batch's layout (PagedDecodeBatch.rows, empty
slots included), so a decode step takes the arrays as they are and hands them back updated,
and its shapes depend on the row count only, as the pool's do. A row's state is written into
its slot when it joins or resumes, and moves with it when the layout is compacted; an empty
slot's rows are computed and never read.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vlmserve.engine.runner import host_arrays


def layer_kinds(layout: list[Any]) -> list[int]:
    """Per layer (ModelAdapter.state_layout): 0 for a KV layer, else how many state arrays it has."""
    return [0 if arrays is None else len(arrays) for arrays in layout]


class RowStates:
    def __init__(self, layout: list[Any], kv_dtype=None):
        """`layout`: the model's state_layout(); `kv_dtype`: the KV dtype of the rows they go with.
        Rows whose KV is wider than the model's (float32 image embeddings beside a bfloat16 model)
        carry state as wide: the arrays are at least that wide."""
        self.specs = [
            (shape, kv_dtype if kv_dtype is not None and kv_dtype.size > dtype.size else dtype)
            for arrays in layout
            if arrays is not None
            for shape, dtype in arrays
        ]
        self.arrays: list[mx.array] = []  # per state array: (slots, *shape); none while no row runs

    def zeros(self, slots: int) -> list[mx.array]:
        return [mx.zeros((slots, *shape), dtype) for shape, dtype in self.specs]

    def reorder(self, order: list[int | None]) -> None:
        """The layout changed: slot i now holds what slot order[i] held (None: an empty slot)."""
        slots = self.arrays[0].shape[0] if self.arrays else 0
        if all(o is None for o in order) or not slots:
            self.arrays = self.zeros(len(order)) if order else []
        elif order[:slots] == list(range(slots)) and all(o is None for o in order[slots:]):  # more slots
            self.arrays = [mx.concatenate([a, z]) for a, z in zip(self.arrays, self.zeros(len(order) - slots))]
        else:
            index = mx.array([slots if o is None else o for o in order], dtype=mx.int32)  # `slots`: a zero row
            self.arrays = [mx.concatenate([a, mx.zeros((1, *a.shape[1:]), a.dtype)])[index] for a in self.arrays]

    def put(self, slots: list[int], rows: list[mx.array | None]) -> None:
        """`rows`: per state array, the states (len(slots), *shape) that go into those slots (None:
        a state the layer has not set yet, zeros)."""
        index = mx.array(slots, dtype=mx.int32)
        for i, (array, row) in enumerate(zip(self.arrays, rows)):
            if row is None:
                row = mx.zeros((len(slots), *array.shape[1:]), array.dtype)
            elif row.dtype.size > array.dtype.size:  # a wider prompt's state (float32 embeddings): kept as is
                array = array.astype(row.dtype)
            array[index] = row
            self.arrays[i] = array

    def take(self, slot: int) -> list[mx.array]:
        """The state of one slot, (1, *shape) per array."""
        return [a[slot : slot + 1] for a in self.arrays]

    def to_host(self, slot: int) -> list:
        return host_arrays.to_host([self.take(slot)])[0]

    @staticmethod
    def of_rows(rows_cache: list[Any], rows: list[int]) -> list[mx.array | None]:
        """Per state array, the states of `rows` of a prefill's caches (their state layers)."""
        index = mx.array(rows, dtype=mx.int32)
        return [None if a is None else a[index] for c in rows_cache for a in c.state]
