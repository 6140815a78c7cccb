"""vLLM's sampling extensions in the per-row sampler (engine/runner/sampling.py): repetition_penalty,
min_p and min_tokens, each off by default."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread
from vlmserve.protocol import SamplingParams


def test_repetition_penalty_divides_seen_positive_logits_and_multiplies_negative_ones():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.sampling import RowSampler, sample_batch

        logits = mx.array([[2.0, -1.0, 3.0, 0.5, -2.0]] * 3)
        sampler = RowSampler.create(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[1, 0, 1])
        first = np.array(sampler.adjust(logits[0]))
        # drawn through the batch's path: each drawn token counts from the next draw, on the device
        drawn = [sample_batch(logits[i : i + 1], [sampler]).item() for i in range(3)]
        after = np.array(sampler.adjust(logits[0]))
        off = RowSampler.create(SamplingParams(temperature=0), prompt_ids=[0, 1])
        return first, drawn, after, sampler.needs_history, off.needs_adjust or off.needs_history

    first, drawn, after, history, off = on_own_thread(work)
    np.testing.assert_allclose(first, [1.0, -2.0, 3.0, 0.5, -2.0])  # the prompt's tokens 0 and 1
    assert drawn == [2, 2, 2]  # 3 / 2 = 1.5 stays the largest
    np.testing.assert_allclose(after, [1.0, -2.0, 1.5, 0.5, -2.0])
    assert not history  # nothing read back: decode steps stay pipelined
    assert not off


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.sampling import RowSampler

        logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
        drawn = {}
        for min_p in (0.0, 0.2, 0.7):
            sampler = RowSampler.create(SamplingParams(temperature=1.0, min_p=min_p, seed=3))
            drawn[min_p] = {sampler.sample(logits).item() for _ in range(300)}
        return drawn

    drawn = on_own_thread(work)
    assert drawn[0.0] == {0, 1, 2, 3}
    assert drawn[0.2] == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert drawn[0.7] == {0}  # 0.3 < 0.7 * 0.5


def test_min_tokens_holds_eos_and_stop_token_ids_back_until_enough_are_out():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.sampling import RowSampler

        logits = mx.array([0.0, 5.0, 9.0, 8.0])  # token 2 is EOS, token 3 a stop token id
        params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(3,))
        sampler = RowSampler.create(params, eos_ids=[2])
        picks, history = [], []
        for _ in range(3):
            history.append(sampler.needs_history)
            token = sampler.sample(sampler.adjust(logits)).item()
            picks.append(token)
            sampler.observe(1 if token != 2 else 2)
        return picks, history

    picks, history = on_own_thread(work)
    assert picks == [1, 1, 2]
    assert history == [True, True, False]  # counted exactly while it holds back, pipelined after
