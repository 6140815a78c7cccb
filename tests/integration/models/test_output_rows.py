"""A prompt forward's output layer over the rows read only (models/output_rows.py) gives the
logits the full projection gives there, for every tiny family: one prompt, two of different
lengths in one left-padded forward, one alone in a left-padded forward, and two in one
right-padded pieces forward."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import families, session_checkpoint
from support.helpers import on_own_thread

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", families())
def test_the_rows_read_get_the_full_projections_logits(family, tmp_path_factory, monkeypatch):
    from vlmserve.models import output_rows
    from vlmserve.models.generic import GenericModel
    from vlmserve.models.registry import load_model_adapter
    from vlmserve.protocol import PreparedRequest

    path = session_checkpoint(family, "float32", tmp_path_factory)
    made = []  # every prompt forward's selection

    class Recorded(output_rows.Selection):
        def __init__(self, positions):
            super().__init__(positions)
            made.append(self)

    def work():
        import mlx.core as mx

        model = load_model_adapter(path, family)
        vocab = model.info.vocab_size
        prompts = [np.array([(7 * i + 11) % (vocab // 2) + 5 for i in range(n)], dtype=np.int32) for n in (9, 5)]

        def logits():
            states = [model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0] for ids in prompts]
            out = [model.prefill(states[0], 0, len(prompts[0]) - 1)]
            if model.can_batch:
                fresh = [model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0] for ids in prompts]
                out.append(model.prefill_batch(fresh, [len(ids) - 1 for ids in prompts])[1])
                # one row alone in a left-padded batch (a lone prompt of a bucketed step), unpadded
                # and padded, through the generic path an adapter may fall back to: Qwen3.5's text
                # model runs such a row through a call of itself
                for bucket in (1, 16):
                    fresh = [model.embed_prompts([PreparedRequest(prompt_ids=prompts[0])])[0]]
                    out.append(GenericModel.prefill_batch(model, fresh, [len(prompts[0]) - 1], bucket)[1])
            if model.prefills_pieces:  # right-padded: each row's last position is its own
                fresh = [model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0] for ids in prompts]
                out.append(model.prefill_pieces(fresh, [(0, len(ids) - 1) for ids in prompts]))
            return [np.array(x.astype(mx.float32)) for x in out]

        selected = logits()
        forwards = len(made)
        with monkeypatch.context() as m:
            m.setattr(output_rows, "_selected", lambda h: h)  # every position projected, then rows read
            full = logits()
        return selected, full, [s.taken for s in made[:forwards]]

    monkeypatch.setattr(output_rows, "Selection", Recorded)
    selected, full, taken = on_own_thread(work)
    # each forward through the generic path projected its rows only (idefics3's from its final norm)
    assert taken and all(taken)
    for got, want in zip(selected, full):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
