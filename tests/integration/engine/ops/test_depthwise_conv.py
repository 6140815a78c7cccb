"""Hybrid families' depthwise convolutions run plan-free (as on CUDA) give mlx_vlm's logits and
greedy tokens: a prompt, a left-padded batch of two, and decode steps through the state."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import on_own_thread, padded_greedy_logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_plan_free_depthwise_convolutions_give_mlx_vlm_logits(family, tmp_path_factory):
    path = session_checkpoint(family, "float32", tmp_path_factory)

    def work():
        from mlx_vlm.utils import load_model

        from vlmserve.engine.ops import depthwise_conv

        plain, swapped = (load_model(path, lazy=False).language_model for _ in range(2))
        count = depthwise_conv.install(swapped, force=True)
        runs = []
        for prompts in ([[5, 17, 42, 7, 99, 3, 11]], [[5, 17, 42, 7, 99, 3, 11], [8, 23, 4]]):
            runs.append((padded_greedy_logits(plain, prompts), padded_greedy_logits(swapped, prompts)))
        return count, runs

    count, runs = on_own_thread(work)
    assert count > 0
    for reference, got in runs:
        for ref, out in zip(reference, got):
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            assert np.array_equal(out.argmax(-1), ref.argmax(-1))
