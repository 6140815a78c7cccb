"""Rows of a model whose layers keep fixed-size state beside their KV (LFM2-VL: convolution
windows; Qwen3.5: convolution windows and recurrent state) decode on the paged KV pool, their
state a row per decode slot (row_states.py), eager and compiled:

- a row taken to host memory mid-decode (KV and state) and resumed gives the logits it gives
  uninterrupted, bit for bit, whether it was the longest, a short one or the only row (and the
  rows beside it theirs, to rounding: their batch was smaller meanwhile);
- rows leaving a wide batch (its slots compacted, each state moving with its row) and rows
  joining later (more slots) give the logits each gives alone, to rounding, and its tokens."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import on_own_thread

STEPS = 8
EVICT_AT, RESUME_AT = 3, 5  # the victim misses the steps in between
LEAVE_AT = 3  # rows that leave the batch take this many steps


def _prefill(model, n: int, seed: int):
    """A row of an n-token prompt (its ids seeded by n and `seed`), prefilled but for its last token."""
    from vlmserve.protocol import PreparedRequest

    ids = np.random.default_rng(n * 100 + seed).integers(model.info.vocab_size // 4, model.info.vocab_size // 2, n)
    state = model.embed_prompts([PreparedRequest(prompt_ids=ids.astype(np.int32))])[0]
    model.prefill(state, 0, n - 1)
    row = types.SimpleNamespace(cache_len=n - 1, prompt=state, last=int(ids[-1]), n=n, blocks=[], prefix_hit=None)
    return row, model.merge_caches([state.cache])


def _run(model, compiled: bool, script: list[tuple[int, str, int]], steps: int) -> dict[int, list[np.ndarray]]:
    """Run `steps` decode steps of a batch that `script` changes: (step, what, prompt length) with
    what in join / leave / evict / resume, each row named by its prompt length. Each row's
    logits per step it took."""
    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DecodeBatches

    batches = DecodeBatches(model, compiled, block_size=16, context_length=512, initial_blocks=64)
    assert batches.paged and batches.state_layout is not None
    batch = batches.new()
    per_slot = sum(
        math.prod(shape) * dtype.size for arrays in batches.state_layout if arrays for shape, dtype in arrays
    )
    rows: dict[int, types.SimpleNamespace] = {}
    held: dict[int, object] = {}
    logits_of: dict[int, list[np.ndarray]] = {}
    for step in range(steps):
        for at, what, n in script:
            if at != step:
                continue
            if what == "join":
                rows[n], cache = _prefill(model, n, 0)
                logits_of[n] = []
                batch.join([rows[n]], cache)
            elif what == "leave":
                batch.remove([rows.pop(n)])
            elif what == "evict":
                held[n] = batch.evict(rows[n])
            else:
                batch.resume(rows[n], held.pop(n))
        batch.grow()
        live = batch.layout()
        # Each decode slot, empty or not, holds a row of state (the memory gauges' row_states).
        assert batch.state_bytes() == len(live) * per_slot
        if not live:  # its only row is on the host
            continue
        tokens = mx.array([0 if row is None else row.last for row in live], dtype=mx.int32)
        pieces = batch.forward_pieces(tokens, live)
        assert len(pieces) == 1
        logits = pieces[0][2]
        for i, row in enumerate(live):
            if row is None:
                continue
            row.cache_len += 1
            row.last = int(mx.argmax(logits[i]).item())
            logits_of[row.n].append(np.array(logits[i].astype(mx.float32)))
    return logits_of


def _same(expected: list[np.ndarray], taken: list[np.ndarray]) -> bool:
    """The same tokens, and logits equal to rounding (a batch of another size may sum otherwise)."""
    return len(expected) == len(taken) and all(
        int(a.argmax()) == int(b.argmax()) and np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(expected, taken)
    )


def _alone(model, compiled: bool, n: int, steps: int) -> list[np.ndarray]:
    return _run(model, compiled, [(0, "join", n)], steps)[n]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_state_rows_on_the_pool_keep_their_own_state(family, compiled, tmp_path_factory):
    from vlmserve.models.registry import load_model_adapter

    path = session_checkpoint(family, "float32", tmp_path_factory)

    def work():
        model = load_model_adapter(path, family)
        failures = []
        # Evicted and resumed: bit for bit what the same batch gives uninterrupted.
        for lengths, victim in (((9, 5, 13), 13), ((9, 5, 13), 5), ((7,), 7)):
            joins = [(0, "join", n) for n in lengths]
            reference = _run(model, compiled, joins, STEPS)
            resumed = _run(model, compiled, [*joins, (EVICT_AT, "evict", victim), (RESUME_AT, "resume", victim)], STEPS)
            for n in lengths:  # fewer rows meanwhile: on a GPU, other kernels (the same to rounding)
                if n != victim and not _same(reference[n], resumed[n]):
                    failures.append(("beside an eviction", lengths, victim, n))
            # The victim missed the steps between: what it took, it took as uninterrupted.
            taken = resumed[victim]
            if len(taken) != STEPS - (RESUME_AT - EVICT_AT) or not all(
                np.array_equal(a, b) for a, b in zip(reference[victim], taken)
            ):
                failures.append(("evicted", lengths, victim))
        # Five rows (eight slots); three leave, the batch narrows to two slots and the fifth row's
        # state moves to the second; then two join (more slots).
        script = [(0, "join", n) for n in (9, 5, 13, 7, 11)]
        script += [(LEAVE_AT, "leave", n) for n in (5, 13, 7)]
        script += [(LEAVE_AT + 2, "join", n) for n in (6, 10)]
        together = _run(model, compiled, script, STEPS)
        for n, taken in together.items():
            if not _same(_alone(model, compiled, n, len(taken)), taken):
                failures.append(("together", n))
        return failures

    failures = on_own_thread(work)
    assert failures == [], failures
