"""A request as the engine holds it, and its row state once admitted. Plain Python, no MLX."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmserve.protocol import PreparedRequest, SamplingParams, TokenEvent


@dataclass(eq=False)  # identity semantics: rows are found in lists by `is`, never by value
class EngineRequest:
    """What the serving side hands to the engine; `emit` delivers events (called on the worker)."""

    request_id: str
    prepared: PreparedRequest
    sampling: SamplingParams
    emit: Callable[[TokenEvent], None]
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set from any thread; read by the worker at its next step
    staged_inputs: Any = None  # its arrays already copied to the device (the runner's staging)


@dataclass(eq=False)
class Sequence:
    """An admitted request's progress. The scheduler reads the counts; the runner's objects
    (sampler, text stream, embedded prompt) ride along without the scheduler looking inside."""

    req: EngineRequest
    sampler: Any
    text: Any
    prompt: Any = None  # the embedded prompt (models' PromptState) once the runner has embedded it
    prefilled: int = 0  # prompt tokens already in its KV cache (prefix-cache hits included)
    cached_tokens: int = 0
    cache_len: int = 0
    last_token: int = -1
    generated: int = 0
    output_ids: list[int] = field(default_factory=list)  # the tokens it generated, in order
    finished: bool = False
    batchable: bool = True  # its prompt cache can join a batched prefill (the runner says, when embedding)
    whole_prompt: bool = False  # its prompt is prefilled in one piece, never in chunks (the runner says)
    last_in_prefill: bool = False  # prefill runs its last prompt position too (the runner says)
    embedded_len: int | None = None  # the embedded prompt's length (a vision merge may change it)
    kv_units: int = 0  # KV budget blocks it holds (reserved at admission, then what its blocks cost)
    blocks: list[int] = field(default_factory=list)  # its KV blocks in the pool of its dtype (the runner's)
    # While it prefills in pieces: its KV blocks so far and their pool (the runner's), until it joins.
    prefill_blocks: list[int] = field(default_factory=list)
    prefill_pool: Any = None
    kv_dtype: Any = None  # the dtype its KV decodes in (the runner's)
    host_kv: Any = None  # its KV while preempted, copied out of the pool
    prefix_hit: Any = None  # the cached prefix its prompt cache starts with (runner's PrefixHit), until it joins
    kv_reusable: bool = True  # its KV may go into a prefix cache (not once kernels since replaced made it)
    # A prompt position its prefill stops at once, where a next turn's prompt parts from this one
    # and a cache of whole keys keeps the row's state (the runner's; 0: none).
    checkpoint: int = 0
    checkpoint_kept: bool = False  # a cache holds its KV and state there (its later entries would serve nothing)

    @property
    def num_prompt(self) -> int:
        """Prompt positions its KV cache will hold: the embedded length once known, else the ids'."""
        return self.embedded_len or self.req.prepared.num_prompt_tokens

    @property
    def prefill_end(self) -> int:
        """Where its prefill stops: before the last prompt position, which rides the first decode
        step (as mlx_vlm.generate splits a prompt), unless prefill must run that one too."""
        return self.num_prompt if self.last_in_prefill else self.num_prompt - 1

    @property
    def piece_end(self) -> int:
        """Where its next pieces stop: its checkpoint until prefilled that far, then `prefill_end`."""
        return self.checkpoint if self.prefilled < self.checkpoint else self.prefill_end

    def next_piece(self, budget: int) -> tuple[int, int]:
        """The prompt positions [start, end) its next piece of at most `budget` tokens covers."""
        return self.prefilled, min(self.piece_end, self.prefilled + budget)

    @property
    def embedded(self) -> bool:
        return self.prompt is not None
