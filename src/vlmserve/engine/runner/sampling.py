"""Per-row sampling: every request keeps its own parameters and its own PRNG stream.

Greedy rows of a batch share one argmax; other rows are sampled one by one from their own
logits row with their own key, so a seeded request samples the same tokens alone or in
any batch. Greedy is the argmax of the log-probabilities in the logits' own dtype, as mlx-lm
and mlx-vlm take it: in bfloat16 the subtraction merges near-ties, and the first of them wins.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx

from vlmserve.protocol import SamplingParams


@dataclass
class RowSampler:
    params: SamplingParams
    key: mx.array | None = None
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> count, for penalties
    logits_mask: object | None = None  # JSON mode: callable() -> additive (V,) mask, .consume(token)

    @classmethod
    def create(cls, params: SamplingParams) -> RowSampler:
        key = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            key = mx.random.key(seed)
        return cls(params=params, key=key)

    @property
    def needs_penalties(self) -> bool:
        return bool(self.counts) and (self.params.presence_penalty or self.params.frequency_penalty)

    @property
    def needs_adjust(self) -> bool:
        return self.needs_penalties or bool(self.params.logit_bias)

    @property
    def needs_history(self) -> bool:
        """Whether the next draw depends on the previous token's value (not just its array)."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty or self.logits_mask is not None)

    def observe(self, token: int) -> None:
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1

    def adjust(self, logits: mx.array) -> mx.array:
        """logit_bias, then penalties, on a (V,) logits row (OpenAI semantics: the bias is added;
        penalties are subtracted per generated token). Bias on ids past the vocabulary is ignored."""
        bias = [(t, b) for t, b in self.params.logit_bias if t < logits.shape[-1]]
        if bias:
            ids = mx.array([t for t, _ in bias], dtype=mx.int32)
            logits = logits.at[ids].add(mx.array([b for _, b in bias], dtype=logits.dtype))
        if not self.needs_penalties:
            return logits
        ids = mx.array(list(self.counts.keys()), dtype=mx.int32)
        counts = mx.array(list(self.counts.values()), dtype=logits.dtype)
        penalty = self.params.presence_penalty + self.params.frequency_penalty * counts
        return logits.at[ids].subtract(penalty)

    def sample(self, logits: mx.array) -> mx.array:
        """Sample one token from a (V,) logits row; returns a scalar int32 array."""
        p = self.params
        if p.greedy:
            return greedy(logits)
        logits = logits.astype(mx.float32) / p.temperature
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
        rows.append(sampler.sample(row).astype(mx.int32))
    return mx.stack(rows)


def greedy(logits: mx.array) -> mx.array:
    """The argmax of the log-probabilities, computed in the logits' dtype (mlx-lm's rule)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
