"""models/output_rows.py on a stand-in language model: the output layer takes each row's hidden
state at its position, once, however the text model reaches its result (here, as Qwen3.5's does
for a one-row batch cache, through a call of itself)."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_the_outermost_call_selects_once_and_outside_every_position_stays():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.models import output_rows

        class Text(nn.Module):
            def __call__(self, h, again=True):
                if again and h.shape[0] == 1:  # one row: its forward again, through the module
                    return self(h, again=False)
                return h * 2

        class Language(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = Text()

            def __call__(self, h):
                return self.model(h) + 1  # the output layer, per position

        lm = Language()
        assert output_rows.install(lm) and output_rows.install(lm)  # a second install changes nothing
        h = mx.arange(2 * 6 * 3, dtype=mx.float32).reshape(2, 6, 3)
        got = []
        for x, positions in ((h[:1], [3]), (h, [5, 2])):
            with output_rows.at(positions) as selection:
                got.append((np.array(lm(x)), selection.taken))
        return np.array(h), got, np.array(lm(h))

    h, got, outside = on_own_thread(work)
    (one, one_taken), (two, two_taken) = got
    assert one_taken and two_taken
    assert one.shape == (1, 1, 3) and np.array_equal(one[:, 0], h[0, [3]] * 2 + 1)
    assert two.shape == (2, 1, 3) and np.array_equal(two[:, 0], h[[0, 1], [5, 2]] * 2 + 1)
    assert np.array_equal(outside, h * 2 + 1)  # no selection outside `at` (decode, probes)
