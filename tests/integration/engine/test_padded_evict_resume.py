"""A padded batch's row (recurrent or convolution state: LFM2-VL, Qwen3.5) goes to host memory
and comes back mid-decode, the longest, a short one or the only row: every row's logits are the
ones it gives with no eviction, bit for bit."""

from __future__ import annotations

import types

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import on_own_thread

STEPS = 8  # decode steps each row takes
EVICT_AT, RESUME_AT = 3, 5  # the victim misses the steps in between


def _run(model, lengths: tuple[int, ...], victim: int | None) -> dict[int, list[np.ndarray]]:
    """Each row's logits per step it took (a run with a victim takes two steps more, so that the
    victim too takes STEPS), rows prefilled from the same prompts every run."""
    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import PaddedDecodeBatch
    from vlmserve.protocol import PreparedRequest

    rng = np.random.default_rng(0)
    vocab = model.info.vocab_size
    batch = PaddedDecodeBatch(model)
    rows = []
    for n in lengths:
        ids = rng.integers(vocab // 4, vocab // 2, n).astype(np.int32)
        state = model.embed_prompts([PreparedRequest(prompt_ids=ids)])[0]
        model.prefill(state, 0, n - 1)
        row = types.SimpleNamespace(cache_len=n - 1, prompt=state, last=int(ids[-1]), n=n)
        batch.join([row], model.merge_caches([state.cache]))
        rows.append(row)
    logits_of: dict[int, list[np.ndarray]] = {row.n: [] for row in rows}
    host = None
    for step in range(STEPS + (RESUME_AT - EVICT_AT if victim is not None else 0)):
        if victim is not None and step == EVICT_AT:
            host = batch.evict(rows[victim])
        if victim is not None and step == RESUME_AT:
            batch.resume(rows[victim], host)
        live = batch.layout()
        if not live:
            continue
        tokens = mx.array([row.last for row in live], dtype=mx.int32)
        ((_, _, logits),) = batch.forward_pieces(tokens, live)
        for i, row in enumerate(live):
            row.cache_len += 1
            row.last = int(mx.argmax(logits[i]).item())
            logits_of[row.n].append(np.array(logits[i].astype(mx.float32)))
    return logits_of


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_an_evicted_row_resumes_with_the_logits_it_gives_uninterrupted(family, tmp_path_factory):
    from vlmserve.models.registry import load_model_adapter

    path = session_checkpoint(family, "float32", tmp_path_factory)

    def work():
        model = load_model_adapter(path, family)
        assert model.row_memory() is not None  # caches the KV budget counts: it may preempt them
        outcomes = []
        for lengths, victim in (((9, 5, 13), 2), ((9, 5, 13), 1), ((7,), 0)):
            reference, resumed = _run(model, lengths, None), _run(model, lengths, victim)
            outcomes.append(
                all(
                    len(resumed[n]) >= STEPS == len(reference[n])
                    and all(np.array_equal(a, b) for a, b in zip(reference[n], resumed[n][:STEPS]))
                    for n in lengths
                )
            )
        return outcomes

    assert on_own_thread(work) == [True, True, True]
