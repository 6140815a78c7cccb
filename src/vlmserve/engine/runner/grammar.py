"""Constrained sampling with llguidance: `response_format` json_object (any JSON object) and
json_schema, and forced tool calls (the grammar arrives built, in SamplingParams.grammar)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

_OBJECT_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))


class GrammarFactory:
    """Builds the llguidance tokenizer once per model (it is expensive) and a matcher per request."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self._ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos_ids[0] if eos_ids else None)

    def new(self, grammar: str | None = None) -> GrammarConstraint:
        """A matcher for `grammar` (None: one JSON object); a grammar llguidance rejects raises."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar or _OBJECT_GRAMMAR, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the output grammar is invalid: {matcher.get_error()}")
        return GrammarConstraint(
            matcher,
            self.vocab_size,
            self._ll_tokenizer.vocab_size,
        )


class GrammarConstraint:
    """Additive logits mask for the next token, advanced with each sampled token."""

    def __init__(self, matcher, vocab_size: int, tokenizer_vocab: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bits = llguidance.numpy.allocate_token_bitmask(1, tokenizer_vocab)
        self._shifts = np.arange(32, dtype=np.int32)

    def __call__(self) -> mx.array:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bits)
        allowed = ((self._bits[0][:, None] >> self._shifts) & 1).reshape(-1).astype(bool)
        full = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, allowed.shape[0])
        full[:n] = allowed[:n]
        return mx.array(np.where(full, 0.0, -np.inf).astype(np.float32))

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
