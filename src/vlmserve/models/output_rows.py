"""A prompt forward's output layer over the positions whose logits are read, not all of them.

mlx_vlm's language models project every position's hidden state to the vocabulary, and a prompt
forward reads one position a row. Over a prefill step of 8,192 tokens (the default budget) with
a 152k vocabulary that is 2.5 GB of bf16 logits, and for a 2B model about a sixth of the step's
FLOPs (2 x hidden x vocab a position against ~2 x the parameters), computed to be dropped; a
262k vocabulary with logit soft-capping holds several times that in temporaries.

Within `at(positions)` the text model (`language_model.model`) hands the code after it (its
output layer and whatever the family does to logits) each row's hidden state at its position
only. Each logit stays its row's dot product over the same values; the model's code is not
copied. A language model that runs its layers itself hands them on from its final norm, which
works per position; one with neither keeps its full logits (`Selection.taken` says which
happened).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn


class Selection:
    """The position a row whose hidden state the output layer takes, and whether it did."""

    def __init__(self, positions: list[int]):
        self.positions = positions
        self.taken = False


_SELECTION: ContextVar[Selection | None] = ContextVar("output_rows", default=None)
_CLASSES: dict[type, type] = {}


def rows_at(x: mx.array, positions: list[int]) -> mx.array:
    """(rows, L, ...) -> (rows, ...): each row's entry at its own position."""
    return x[mx.arange(len(positions)), mx.array(positions)]


def _selected(h):
    selection = _SELECTION.get()
    if selection is None or selection.taken or not isinstance(h, mx.array) or h.ndim != 3:
        return h  # (once a forward: a second call's input would be the rows already)
    if h.shape[0] != len(selection.positions) or max(selection.positions) >= h.shape[1]:
        return h  # not the forward's positions: MLX's gather would read past them unchecked
    selection.taken = True
    return rows_at(h, selection.positions)[:, None, :]


def _selecting(base: type) -> type:
    if base not in _CLASSES:

        def __call__(self, *args, **kwargs):
            # The outermost call selects, once: a text model that calls itself (Qwen3.5 runs a
            # one-row batch cache, and each row of a left-padded batch, through `self(...)`)
            # gets every position back from those calls.
            token = _SELECTION.set(None)
            try:
                h = base.__call__(self, *args, **kwargs)
            finally:
                _SELECTION.reset(token)
            return _selected(h)

        _CLASSES[base] = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return _CLASSES[base]


def install(language_model: nn.Module) -> bool:
    """Let `at` select the rows `language_model`'s inner text model hands on (or, for one that
    runs its layers itself, its final norm: Idefics3's); False where it has neither."""
    inner = getattr(language_model, "model", None)
    if not isinstance(inner, nn.Module) and isinstance(getattr(language_model, "layers", None), list):
        inner = getattr(language_model, "norm", None)
    if not isinstance(inner, nn.Module):
        return False
    if type(inner) not in _CLASSES.values():
        inner.__class__ = _selecting(type(inner))  # same attributes and parameters
    return True


@contextlib.contextmanager
def at(positions: list[int]):
    """Within: a forward's output layer takes only row b's hidden state at positions[b]."""
    selection = Selection(positions)
    token = _SELECTION.set(selection)
    try:
        yield selection
    finally:
        _SELECTION.reset(token)
