"""Arrays copied to host memory and back (a preempted row's KV and state, until it resumes)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_HOST_VIEW = {mx.bfloat16: mx.uint16}  # dtypes NumPy lacks travel to the host as same-size ints


def to_host(arrays: list[mx.array | None]) -> list[tuple[np.ndarray, mx.Dtype] | None]:
    """Each array (None stays None) as a NumPy copy with the dtype it comes back as."""
    views = [None if a is None else a.view(_HOST_VIEW.get(a.dtype, a.dtype)) for a in arrays]
    mx.eval([v for v in views if v is not None])
    return [None if a is None else (np.array(v), a.dtype) for a, v in zip(arrays, views)]


def from_host(copies: list[tuple[np.ndarray, mx.Dtype] | None]) -> list[mx.array | None]:
    """The arrays `to_host` copied, on the device again."""
    return [None if c is None else mx.array(c[0]).view(c[1]) for c in copies]
