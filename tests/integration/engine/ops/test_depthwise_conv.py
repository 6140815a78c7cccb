"""Hybrid families' depthwise convolutions run plan-free (as on CUDA) give mlx_vlm's logits and
greedy tokens: a prompt, a left-padded batch of two, and decode steps through the state."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import greedy_logits, on_own_thread

pytestmark = pytest.mark.slow


def _logits(lm, prompts: list[list[int]], steps: int = 3) -> list[np.ndarray]:
    """The prompts left-padded into one forward through the model's own caches, then `steps`
    greedy one-token steps."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    caches = vlm_cache.make_prompt_cache(lm)
    for c in caches:
        if isinstance(c, vlm_cache.ArraysCache):
            c.left_padding = mx.array(pads)  # the state layers mask the padding
    ids = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    return greedy_logits(lm, ids, caches, steps)


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
            runs.append((_logits(plain, prompts), _logits(swapped, prompts)))
        return count, runs

    count, runs = on_own_thread(work)
    assert count > 0
    for reference, got in runs:
        for ref, out in zip(reference, got):
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            assert np.array_equal(out.argmax(-1), ref.argmax(-1))
