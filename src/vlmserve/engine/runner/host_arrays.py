"""Arrays copied to host memory and back (a preempted row's KV and state, until it resumes)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_HOST_VIEW = {mx.bfloat16: mx.uint16}  # dtypes NumPy lacks travel to the host as same-size ints


def to_host(groups: list[list[mx.array | None]]) -> list[list[tuple[np.ndarray, mx.Dtype] | None]]:
    """Each array of each group (None stays None) as a NumPy copy with the dtype it comes back
    as; one evaluation for all of them."""
    views = [[None if a is None else a.view(_HOST_VIEW.get(a.dtype, a.dtype)) for a in group] for group in groups]
    mx.eval([v for group in views for v in group if v is not None])
    return [
        [None if a is None else (np.array(v), a.dtype) for a, v in zip(group, viewed)]
        for group, viewed in zip(groups, views)
    ]


def from_host(copies: list[tuple[np.ndarray, mx.Dtype] | None]) -> list[mx.array | None]:
    """The arrays `to_host` copied, on the device again."""
    return [None if c is None else mx.array(c[0]).view(c[1]) for c in copies]
