"""Per-row sampling: every request keeps its own parameters and its own PRNG stream.

Greedy rows of a batch share one argmax; other rows are sampled one by one from their own
logits row with their own key, so a seeded request samples the same tokens alone or in
any batch. Greedy is the argmax of the log-probabilities in the logits' own dtype, as mlx-lm
and mlx-vlm take it: in bfloat16 the subtraction merges near-ties, and the first of them wins.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vlmserve.protocol import SamplingParams


@dataclass
class RowSampler:
    params: SamplingParams
    key: mx.array | None = None
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> count, for penalties
    logits_mask: object | None = None  # JSON mode: callable() -> additive (V,) mask, .consume(token)
    # repetition_penalty: the prompt's distinct ids (the (V,) mask is made from them at the first
    # draw, when the vocabulary is known), then that mask, each drawn token set in it on the
    # device: the next draw needs no token read back.
    prompt_ids: np.ndarray | None = None
    seen: mx.array | None = None
    held_back: tuple[int, ...] = ()  # EOS and stop token ids, masked until min_tokens are out
    generated: int = 0

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids=(), eos_ids=()) -> RowSampler:
        key = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            key = mx.random.key(seed)
        sampler = cls(params=params, key=key)
        if params.repetition_penalty != 1.0:
            sampler.prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        if params.min_tokens > 0:
            sampler.held_back = tuple(sorted({*(int(t) for t in eos_ids), *params.stop_token_ids}))
        return sampler

    @property
    def needs_penalties(self) -> bool:
        return bool(self.counts) and bool(self.params.presence_penalty or self.params.frequency_penalty)

    @property
    def holds_back(self) -> bool:
        """EOS and stop token ids are still masked (fewer than min_tokens generated)."""
        return bool(self.held_back) and self.generated < self.params.min_tokens

    @property
    def needs_adjust(self) -> bool:
        return (
            self.needs_penalties
            or bool(self.params.logit_bias)
            or self.params.repetition_penalty != 1.0
            or self.holds_back
        )

    @property
    def needs_history(self) -> bool:
        """Whether the next draw depends on the previous token's value read back on the host (or,
        for min_tokens, on its being counted there)."""
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or self.logits_mask is not None or self.holds_back)

    def observe(self, token: int) -> None:
        self.generated += 1
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1

    def drew(self, token: mx.array) -> None:
        """A token (still on the device) was drawn for this row: it counts as seen from the next draw."""
        if self.seen is not None:
            self.seen = self.seen.at[token].add(1.0)

    def adjust(self, logits: mx.array) -> mx.array:
        """logit_bias, then the repetition penalty (vLLM's, in float32: a seen token's positive
        logit divided by it, a negative one multiplied), then OpenAI's penalties (subtracted per
        generated token), then EOS and stop token ids held back until min_tokens, on a (V,)
        logits row. Bias on ids past the vocabulary is ignored."""
        vocab = logits.shape[-1]
        bias = [(t, b) for t, b in self.params.logit_bias if t < vocab]
        if bias:
            ids = mx.array([t for t, _ in bias], dtype=mx.int32)
            logits = logits.at[ids].add(mx.array([b for _, b in bias], dtype=logits.dtype))
        penalty = self.params.repetition_penalty
        if penalty != 1.0:
            if self.seen is None:
                ids = self.prompt_ids[self.prompt_ids < vocab] if self.prompt_ids is not None else []
                # float32, not bool: a float32 scatter is one of the indexing kernels built ahead on CUDA
                self.seen = mx.zeros((vocab,), dtype=mx.float32).at[mx.array(ids, dtype=mx.int32)].add(1.0)
                self.prompt_ids = None
            logits = logits.astype(mx.float32)
            logits = mx.where(self.seen > 0, mx.where(logits > 0, logits / penalty, logits * penalty), logits)
        if self.needs_penalties:
            ids = mx.array(list(self.counts.keys()), dtype=mx.int32)
            counts = mx.array(list(self.counts.values()), dtype=logits.dtype)
            penalty = self.params.presence_penalty + self.params.frequency_penalty * counts
            logits = logits.at[ids].subtract(penalty)
        held = [t for t in self.held_back if t < vocab] if self.holds_back else []
        if held:
            logits = logits.at[mx.array(held, dtype=mx.int32)].add(mx.array(-mx.inf, dtype=logits.dtype))
        return logits

    def sample(self, logits: mx.array) -> mx.array:
        """Sample one token from a (V,) logits row; returns a scalar int32 array."""
        p = self.params
        if p.greedy:
            return greedy(logits)
        logits = logits.astype(mx.float32) / p.temperature
        if p.min_p > 0.0:
            # p(token) < min_p * p(likeliest)  <=>  logit < max logit + log(min_p); before top-k
            # and top-p, as vLLM applies it
            logits = mx.where(logits < logits.max() + math.log(p.min_p), -mx.inf, logits)
        if 0 < p.top_k < logits.shape[-1]:
            kth = mx.sort(logits)[-p.top_k]
            logits = mx.where(logits < kth, -mx.inf, logits)
        if 0.0 < p.top_p < 1.0:
            order = mx.argsort(-logits)
            sorted_logits = logits[order]
            probs = mx.softmax(sorted_logits, axis=-1)
            cum = mx.cumsum(probs) - probs  # mass before each token
            sorted_logits = mx.where(cum >= p.top_p, -mx.inf, sorted_logits)
            logits = mx.zeros_like(logits).at[order].add(sorted_logits)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logits, key=sub)


def sample_batch(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """logits (B, V) -> tokens (B,) int32, each row by its own sampler."""
    plain = all(s.params.greedy and not s.needs_adjust and s.logits_mask is None for s in samplers)
    if plain:
        return greedy(logits).astype(mx.int32)
    rows = []
    for i, sampler in enumerate(samplers):
        row = sampler.adjust(logits[i])
        if sampler.logits_mask is not None:
            row = row + sampler.logits_mask()
        token = sampler.sample(row).astype(mx.int32)
        sampler.drew(token)
        rows.append(token)
    return mx.stack(rows)


def greedy(logits: mx.array) -> mx.array:
    """The argmax of the log-probabilities, computed in the logits' dtype (mlx-lm's rule)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
