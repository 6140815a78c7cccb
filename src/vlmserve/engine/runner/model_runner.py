"""Carries out the scheduler's decisions on the device: embed, prefill, decode, sample, detokenize.

Every request owns its sampler, PRNG key, stop strings, position state and KV cache; it joins
the running batch's cache (decode_batch.py) once its prompt is in. Runs on the MLX worker only.

KV blocks are counted against the scheduler's KVBudget: a joining row pays for its prompt's
blocks (reserved when it was admitted), a running row for each new block as its output
grows. When a step's rows need more blocks than are free, the rows that arrived last are
preempted: their KV is copied to host memory and they resume, exactly where they were, once
blocks are free again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from vlmserve.engine.runner import pool_prefill
from vlmserve.engine.runner.block_pool import BlockPool, kv_block_bytes
from vlmserve.engine.runner.decode_batch import DecodeBatches, kv_dtype
from vlmserve.engine.runner.prefix_cache import (
    PrefixCache,
    StateBudget,
    content_keyed,
    restore_states,
    state_limit_bytes,
)
from vlmserve.engine.runner.row_states import RowStates
from vlmserve.engine.runner.sampling import RowSampler, log_softmax, sample_batch
from vlmserve.engine.runner.text_stream import TextStream
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.request import EngineRequest, Sequence
from vlmserve.engine.sched.scheduler import TOO_LONG, PromptTooLong, Scheduler
from vlmserve.models import kv_caches
from vlmserve.protocol import FinishReason, PreparedRequest, SamplingParams, TokenEvent, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

# A prefix hit this short is not taken by a row that could join a batched prefill (ModelRunner._embedded).
MIN_PREFIX_HIT = 64
SHORT_PIECE = 16  # pieces this short go apart from long ones (_short_pieces_apart)
# Query-key pairs one forward of prompt pieces may attend over (its attention is not fused: the
# scores are materialized, ~1 GB in bf16 at this bound for a model with 16 heads): 16 pieces of 512
# tokens over 4k tokens of context. Longer contexts split into more forwards.
PIECES_MAX_PAIRS = 1 << 25
_EMPTY_SLOT_SAMPLER = RowSampler(params=SamplingParams(temperature=0.0))  # rows nobody owns: cheapest draw


def _by_embedding_dtype(items: list, row_of: Callable[[Any], Sequence]) -> list[list]:
    """`items` in order, grouped by their row's prompt embedding dtype (one forward per dtype)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(row_of(item).prompt.embeds.dtype, []).append(item)
    return list(groups.values())


def _piece_length(seq: Sequence, budget: int) -> int:
    """Positions a row's next piece runs in a pieces forward (a row with nothing left counts one)."""
    start, end = seq.next_piece(budget)
    return max(1, end - start)


def _short_pieces_apart(rows: list[tuple[Sequence, int]], together: bool) -> list:
    """A pieces forward runs every row at its longest piece: pieces of a few tokens (a prompt's
    rest after its checkpoint) beside long ones go into a forward of their own where their
    padding would cost more than one more long row."""
    if not together:
        return [(rows, together)]
    lengths = [_piece_length(seq, budget) for seq, budget in rows]
    longest = max(lengths)
    short = [row for row, n in zip(rows, lengths) if n <= SHORT_PIECE]
    if not short or len(short) == len(rows) or len(short) * (longest - SHORT_PIECE) <= longest:
        return [(rows, together)]
    return [([row for row, n in zip(rows, lengths) if n > SHORT_PIECE], True), (short, True)]


def _joined(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)


@dataclass
class StepStats:
    steps: int = 0
    decode_steps: int = 0
    batched_prefills: int = 0  # forwards that prefilled several requests at once


class ModelRunner:
    def __init__(
        self,
        model,
        tokenizer: TextCodec,
        sched: Scheduler,
        *,
        prefix_cache_tokens: int = 65536,
        mm_cache: bool = False,
        compile_decode: bool = False,
        initial_pool_tokens: int = 16384,  # what a pool holds before it first grows
        hooks: Any = None,
    ):
        self.model = model  # the family's ModelAdapter (models/)
        self.tokenizer = tokenizer
        self.sched = sched
        self.hooks = hooks
        self.budget = sched.kv_budget

        self.eos = set(model.info.eos_token_ids) | set(tokenizer.eos_token_ids)
        self.context_length = model.info.context_length
        self.batch = None  # the running rows' KV caches (decode_batch.py); None while nothing runs
        self.batches = DecodeBatches(
            model,
            compile_decode,
            block_size=self.budget.block_size,
            context_length=self.context_length,
            initial_blocks=min(self.budget.total, self.budget.blocks_for(initial_pool_tokens)) + 1,
            budget_blocks=lambda: self.budget.total,
            weight=self._weight,
            reclaim=self._evict_cached,
            cached=self._cached_holds,
            renumber=self._renumber_cached,
            holders=self._holders_in,
        )
        # A model whose layers keep state beside their KV, on the pool: its entries carry it.
        whole_keys = self.batches.state_layout is not None
        position_bytes = kv_block_bytes(model, 1) if whole_keys else 1
        # Both caches' states within one limit: the one the KV budget set aside (EngineCore.kv_budget).
        states = StateBudget(state_limit_bytes(prefix_cache_tokens, position_bytes))

        def cache(on: bool) -> PrefixCache | None:
            if not on or prefix_cache_tokens <= 0:
                return None
            return PrefixCache(prefix_cache_tokens, whole_keys, position_bytes, states)

        self.prefix_cache = cache(True)
        # Requests with images: keys that carry each image's content (prefix_cache.content_keyed).
        self.mm_prefix_cache = cache(mm_cache)
        self.stats = StepStats()
        self.inflight = None  # (rows, tokens, logprobs, t0) of the launched, unread decode step
        # Host time, in ms, spent launching decode steps (graphs built and queued) and handing out
        # their tokens once read back, since `take_host_ms`: the step trace reports them.
        self.host_ms = {"launch": 0.0, "resolve": 0.0}
        self._kv_dtype_of: dict[Any, Any] = {}  # a prompt's embedding dtype -> the KV dtype its joins had
        self.flush_events = lambda: None  # hands emitted events over now (set by the engine)
        self._weights: dict = {}  # KV dtype -> budget blocks a block costs (_weight)
        self._grammar_factory = None
        self._grammar_tried = False  # prepare_grammars ran (built, or failed: left to requests)

    # ---- admission -------------------------------------------------------------------
    def new_row(self, req: EngineRequest) -> Sequence:
        sampler = RowSampler.create(req.sampling, req.prepared.prompt_ids, self.eos)
        if req.sampling.json_mode or req.sampling.grammar:
            sampler.logits_mask = self._grammars().new(req.sampling.grammar)
        text = TextStream(self.tokenizer.new_detokenizer(), req.sampling.stop, req.sampling.min_tokens)
        return Sequence(req=req, sampler=sampler, text=text)

    def _grammars(self):
        if self._grammar_factory is None:
            from vlmserve.engine.runner.grammar import GrammarFactory

            self._grammar_factory = GrammarFactory(self.tokenizer.hf, self.model.info.vocab_size, sorted(self.eos))
        return self._grammar_factory

    def grammars_pending(self) -> bool:
        """Whether the structured-output tokenizer is still to build (`prepare_grammars`)."""
        return self._grammar_factory is None and not self._grammar_tried

    def prepare_grammars(self) -> None:
        """Build the structured-output tokenizer ahead of the first request that needs it: ~1 s
        for a 150k vocabulary, which that request would otherwise spend on this thread while
        every stream waits. One that fails is tried again by that request, which then fails."""
        self._grammar_tried = True
        t0 = time.perf_counter()
        try:
            self._grammars()
        except Exception as e:  # noqa: BLE001 - the request that asks for it reports why
            log.warning("could not build the structured-output tokenizer ahead of use: %s", e)
            return
        log.info("structured outputs: tokenizer built in %.2f s", time.perf_counter() - t0)

    # ---- embedding -------------------------------------------------------------------
    def embed(self, seq: Sequence) -> None:
        """Vision encoder + embeddings (once per request), and the prefix cache for text-only
        prompts. Raises PromptTooLong for a prompt that embeds longer or wider than the whole KV
        budget holds (admission counted its ids in the model's dtype): it ends before any token."""
        if seq.prompt is None:
            t0 = time.perf_counter()
            prompt = self.model.embed_prompts([seq.req.prepared], [seq.req.staged_inputs])[0]
            self._embedded(seq, prompt, time.perf_counter() - t0)
        if self.budget.bounded and seq.prompt.embeds is not None:
            # The KV dtype its prefill will make: what an earlier join saw for this embedding dtype
            # (some models cast a wider embedding to their own dtype, others keep it); None: the model's.
            dtype = self._kv_dtype_of.get(seq.prompt.embeds.dtype)
            if self._never_fits(seq, dtype):
                need = self._cost(seq.prefill_end + 1, dtype)
                raise PromptTooLong(
                    f"the prompt embeds to {seq.prefill_end + 1} positions of {dtype or 'the model dtype'} KV: "
                    f"{need} KV blocks; the budget holds {self.budget.full}"
                )

    def embed_together(self, seqs: list[Sequence]) -> None:
        """Embed several new requests in one call, so their images go through the vision tower
        together. If that fails, each is embedded alone later (by `embed`) and only a bad one ends."""
        t0 = time.perf_counter()
        try:
            prompts = self.model.embed_prompts([s.req.prepared for s in seqs], [s.req.staged_inputs for s in seqs])
        except Exception:
            log.warning("batched embedding of %d requests failed; embedding them one by one", len(seqs), exc_info=True)
            return
        share = (time.perf_counter() - t0) / len(seqs)
        for seq, prompt in zip(seqs, prompts):
            self._embedded(seq, prompt, share)

    def _embedded(self, seq: Sequence, prompt, seconds: float) -> None:
        prepared = seq.req.prepared
        seq.prompt = prompt
        seq.embedded_len = int(prompt.embeds.shape[1])
        seq.last_in_prefill = prompt.last_from_prompt or (self.model.samples_in_prefill and not self.model.prefix_lm)
        # Plain KV, or state layers beside it where they decode on the pool; a padded batch's rows
        # join one at a time.
        shares = kv_caches.all_plain(prompt.cache) or self.batches.state_layout is not None
        seq.batchable = self.model.can_batch and shares and not prompt.last_from_prompt
        seq.whole_prompt = self.model.prefix_lm
        seq.req.staged_inputs = None  # the prompt holds what it needs of them
        cache, key = self._prefix_cache(seq)
        if cache is not None:
            # A hit takes the row out of the new prompts' forward into the one of prompts continuing
            # a cache (a second forward, ragged): a row that could join the first takes only a hit
            # long enough to pay for that, or half its prompt (not the chat template's opening
            # tokens that every request shares).
            least = min(MIN_PREFIX_HIT, len(key) // 2) if seq.batchable else 1
            pool = self._pieces_pool([seq], create=False) if seq.batchable and self.model.prefills_pieces else None
            found = cache.find(key, least, pool) if pool is not None else None
            if found is not None:  # its pieces go into the pool: the prefix stays there, shared
                pool_prefill.hit_in(seq, pool, *found)
                restore_states(prompt.cache, found[0])  # state layers: the entry's, in its own caches
            else:
                seq.prefix_hit = cache.lookup(key, prompt.cache, least)
                seq.prefilled = seq.prefix_hit.length if seq.prefix_hit else 0
            seq.cached_tokens = seq.prefilled
            if self.hooks:
                self.hooks.on_prefix_lookup(seq.cached_tokens > 0, prepared.has_pixels)
            # Where a next turn's prompt parts from this one before its end (a template whose
            # generation prompt opens what the next turn's history renders otherwise), a cache of
            # whole keys has no state there to resume: the prefill stops there once, and the pieces
            # forward that goes on keeps it (_keep_checkpoints).
            at = prepared.turn_prefix
            keeps = cache.whole_keys and seq.batchable and self.model.prefills_pieces and seq.kv_reusable
            # (the pieces forward writes the pool of the model's KV dtype: a prompt embedded in
            # another goes on in its own cache, where nothing is kept)
            keeps = keeps and self._in_kv_dtype([seq])
            if keeps and max(seq.prefilled + 1, MIN_PREFIX_HIT) <= at < seq.prefill_end:
                seq.checkpoint = at
        # A hit's copy reads the pool's arrays of this moment: queued now, it lets them go.
        copied = [c.state for c in prompt.cache] if seq.cached_tokens else []
        mx.async_eval(prompt.embeds, *copied, *(seq.prefill_pool.arrays() if seq.prefill_pool is not None else []))
        if self.hooks and prepared.has_pixels:
            self.hooks.on_vision(seconds)

    def stage(self, reqs: list[EngineRequest]) -> None:
        """Copy these requests' inputs to the device now, ahead of their embedding.

        Those copies are host work. Done at the next step's start, the device idles through
        them (about a millisecond per image request). Here they overlap the prefill just
        launched (its last command buffers are still queued: async_eval returns that far
        ahead), or the decode step running meanwhile. A failure leaves the copy to the
        embedding, where it ends only that request."""
        for req in reqs:
            try:
                req.staged_inputs = self.model.stage_inputs(req.prepared)
            except Exception:  # noqa: BLE001 - embedding copies again and reports it
                log.warning("staging request %s failed", req.request_id, exc_info=True)

    # ---- prefill ---------------------------------------------------------------------
    def prefill_single(self, seq: Sequence, budget: int) -> None:
        """Prefill up to `budget` more of prompt[:-1]; once it is in, the row joins the batch.
        The last prompt token then rides the next batched decode step, which samples the first
        token: how mlx_vlm.generate splits the prompt too (chunks, then the last token alone).
        A row whose prefill runs its last position too (`last_in_prefill`) takes its first token
        from this forward."""
        if seq.prefill_pool is not None:  # its KV so far is in the pool: back into its own cache
            pool_prefill.back_to_own_cache(seq)
        target = seq.prefill_end
        end = min(seq.piece_end, seq.prefilled + budget)
        logits = None
        if end > seq.prefilled:
            t0 = time.perf_counter()
            if seq.prompt.last_from_prompt and end == target and end - 1 > seq.prefilled:
                # The last position runs alone, as mlx_vlm.generate runs it: some models give
                # another first token when it shares a forward with the positions before it.
                self.model.prefill(seq.prompt, seq.prefilled, end - 1)
                seq.prefilled = end - 1
            logits = self.model.prefill(seq.prompt, seq.prefilled, end)
            # Queue it and move on: the device runs it between decode steps, no host stall.
            mx.async_eval([c.state for c in seq.prompt.cache])
            seq.prefilled = end
            if self.hooks:
                self.hooks.on_prefill(time.perf_counter() - t0)
        if end < target:
            return
        if seq.last_in_prefill and not self._first_tokens([seq], logits):
            return  # its one token was its last: it never decodes
        self._join([seq], self.model.merge_caches([seq.prompt.cache]))

    def prefill_pieces(self, pieces: list[tuple[Sequence, int]]) -> None:
        """The next piece (up to its budget) of several rows' prompts, in one forward per embedding
        dtype whatever each row holds already; rows whose prompts are then in join the batch.

        A row continuing its own cache takes that forward even alone: the single path's attention
        over a cache (cuDNN's on CUDA) builds a plan for every new context length, ~90 ms each on
        an H100, where this one's has no plan. A lone first piece, or a model that cannot take such
        a forward, goes through `prefill_single` (mlx_vlm.generate's shapes)."""
        for same_dtype in _by_embedding_dtype(pieces, lambda piece: piece[0]):
            forwards = self._pieces_forwards(same_dtype) if self.model.prefills_pieces else [(same_dtype, False)]
            for rows, together in forwards:
                if not together:
                    for seq, budget in rows:
                        self.prefill_alone(seq, budget)
                    continue
                try:
                    self._prefill_pieces_together(rows)
                except Exception as exc:  # e.g. joining the batch failed: these requests end, others go on
                    for seq, _ in rows:
                        if not seq.finished and seq in self.sched.prefilling:
                            self.fail_prefill(seq, exc)

    @staticmethod
    def _pieces_forwards(rows: list[tuple[Sequence, int]]) -> list[tuple[list[tuple[Sequence, int]], bool]]:
        """The rows, as (rows, together) forwards: together, their attention scores (rows x longest
        piece x widest context: that attention is not fused) stay within PIECES_MAX_PAIRS; a row
        past it on its own goes alone, through the single-prompt path's fused attention (a row
        whose KV is in the pool goes back to its own cache for that)."""
        forwards: list[tuple[list[tuple[Sequence, int]], bool]] = []
        current: list[tuple[Sequence, int]] = []
        longest = width = 0
        for seq, budget in rows:
            n = _piece_length(seq, budget)
            end = seq.prefilled + n
            if n * end > PIECES_MAX_PAIRS:
                forwards.append(([(seq, budget)], False))
                continue
            if current and (len(current) + 1) * max(longest, n) * max(width, end) > PIECES_MAX_PAIRS:
                forwards.append((current, True))
                current, longest, width = [], 0, 0
            current.append((seq, budget))
            longest, width = max(longest, n), max(width, end)
        if current:
            forwards.append((current, True))
        return [part for forward in forwards for part in _short_pieces_apart(*forward)]

    def prefill_alone(self, seq: Sequence, budget: int) -> None:
        """`prefill_single`; a failure ends only that request."""
        try:
            self.prefill_single(seq, budget)
        except Exception as exc:  # one bad request ends only itself
            self.fail_prefill(seq, exc)

    def _prefill_pieces_together(self, rows: list[tuple[Sequence, int]]) -> None:
        t0 = time.perf_counter()
        spans = [seq.next_piece(budget) for seq, budget in rows]
        seqs = [seq for seq, _ in rows]
        # A prefix hit may leave nothing before the last token: such a row only joins.
        todo = [(seq, span) for seq, span in zip(seqs, spans) if span[1] > span[0]]
        logits = None  # each row of todo's last logits, from the forward they share

        def lone_first_piece() -> bool:  # mlx_vlm.generate's shapes
            return len(todo) == 1 and todo[0][1][0] == 0 and todo[0][0].prefill_pool is None

        pool = self._pieces_pool([seq for seq, _ in todo]) if todo and not lone_first_piece() else None
        unpaid = []  # rows the budget cannot hold that far now: on in their own caches, their join settles
        if pool is not None:
            todo, unpaid = self._pay_for_pieces(todo, pool.dtype)
        if todo and lone_first_piece():
            self.prefill_alone(todo[0][0], todo[0][1][1])
        elif todo:
            # The padded length, given as the multiple to round to: the forward runs exactly it.
            padded = self.sched.padded_length(max(end - start for _, (start, end) in todo))
            moved = [seq for seq, _ in todo if pool is not None and seq.prefill_pool is None]
            try:
                caches = pool_prefill.pieces_caches(pool, todo) if pool is not None else None
                if pool is not None:
                    self._keep_checkpoints(todo, pool)
                logits = self.model.prefill_pieces(
                    [s.prompt for s, _ in todo], [span for _, span in todo], padded, caches=caches
                )
            except Exception as exc:  # noqa: BLE001 - nothing was written where a row reads: one at a time
                log.warning("prefilling %d prompts' pieces together failed; one at a time: %r", len(todo), exc)
                for seq in moved:  # their own caches still hold their prompts so far
                    pool_prefill.leave(seq)
                for seq, (start, end) in todo:  # (rows whose KV is in the pool go back to their own caches)
                    self.prefill_alone(seq, end - start)
            else:
                self.stats.batched_prefills += 1
                if pool is not None:
                    for seq in moved:  # its KV is in the pool now: its own cache lets go of it
                        for layer in kv_caches.kv_layers(seq.prompt.cache):
                            layer.keys = layer.values = None
                            layer.offset = 0
                    # And the rows' new state in their own caches: left lazy, it would hold the
                    # forward's per-layer inputs until the next step reads it.
                    states = [c.state for s, _ in todo for c in kv_caches.state_layers(s.prompt.cache)]
                    mx.async_eval(pool.arrays(), *[a for arrays in states for a in arrays if a is not None])
                else:
                    mx.async_eval([c.state for s, _ in todo for c in s.prompt.cache])
                if self.hooks:
                    self.hooks.on_prefill(time.perf_counter() - t0)
        for seq, (start, end) in unpaid:
            self.prefill_alone(seq, end - start)
        done = []
        for seq, (_, end) in zip(seqs, spans):
            if seq.finished or seq not in self.sched.prefilling:  # prefill_alone took it
                continue
            seq.prefilled = end
            if end == seq.prefill_end:
                done.append(seq)
        sampling = [s for s in done if s.last_in_prefill]  # in todo: their last position is a piece's
        if sampling:
            row = {id(s): i for i, (s, _) in enumerate(todo)}
            picked = logits[mx.array([row[id(s)] for s in sampling], dtype=mx.int32)]
            going = {id(s) for s in self._first_tokens(sampling, picked)}
            done = [s for s in done if not s.last_in_prefill or id(s) in going]
        pooled = [s for s in done if s.prefill_pool is not None]
        done = [s for s in done if s.prefill_pool is None]
        if pooled:
            self._join(pooled, None)
        if done:
            self._join(done, self.model.merge_caches([s.prompt.cache for s in done]))

    def _pieces_pool(self, seqs: list[Sequence], create: bool = True) -> BlockPool | None:
        """The block pool a pieces forward of these rows writes their KV into, or None: each row
        goes on in its own cache (no paged batch, or prompts that embed in another dtype than
        the model's KV: such a row decodes in its own dtype's pool; or, unless `create`, no
        such pool yet)."""
        held = {id(s.prefill_pool): s.prefill_pool for s in seqs if s.prefill_pool is not None}
        if held:
            if len(held) > 1:
                raise RuntimeError("rows prefilled into different KV pools")
            return next(iter(held.values()))
        if not self.batches.paged or not self._in_kv_dtype(seqs):
            return None
        dtype = self.model.kv_layout()[2]
        return self.batches.pool(dtype) if create else self.batches.pools.get(dtype)

    def _in_kv_dtype(self, seqs: list[Sequence]) -> bool:
        """Whether these prompts embed in the model's KV dtype (others decode in a pool of their own)."""
        dtype = self.model.kv_layout()[2]
        return all(s.prompt.embeds.dtype == dtype for s in seqs)

    def _pay_for_pieces(self, todo: list, dtype) -> tuple[list, list]:
        """Before prefilling rows' pieces take blocks of the pool: the budget counts each row's
        positions up to its piece's end (`_take_positions`). Returns the rows it holds and those it
        cannot hold now, which go on in caches of their own (their join settles, and may set them
        aside until blocks free up); a row the whole budget could never hold ends here."""
        paid, unpaid = [], []
        for seq, span in todo:
            if self._take_positions(seq, span[1], dtype):
                paid.append((seq, span))
            elif self._never_fits(seq, dtype):
                self._too_long(seq)
            else:
                unpaid.append((seq, span))
        return paid, unpaid

    def _take_positions(self, seq: Sequence, positions: int, dtype) -> bool:
        """The budget counts a prefilling row's `positions` of `dtype` KV where they pass what
        admission reserved (from the prompt's ids, in the model's dtype: a vision merge may embed it
        longer, or wider), making room by preempting rows that arrived after it; False (nothing
        taken) if that would not free enough."""
        extra = self._cost(positions, dtype) - seq.kv_units if self.budget.bounded else 0
        if extra <= 0:
            return True
        if self._make_room(extra, keep=seq) and self.budget.take(extra):
            seq.kv_units += extra
            return True
        return False

    def _never_fits(self, seq: Sequence, dtype) -> bool:
        """Whether a prompt's KV of `dtype`, with its first token's position, passes the whole
        budget (what is lent to the compile rehearsal included): it could never run."""
        return self._cost(seq.prefill_end + 1, dtype) > self.budget.full

    def _too_long(self, seq: Sequence, error: str = "its prompt needs more KV memory than the budget holds") -> None:
        self.sched.drop_prefilling(seq)
        self.finish(seq, FinishReason.ERROR, error=error, error_code=TOO_LONG)

    def _first_tokens(self, seqs: list[Sequence], logits: mx.array) -> list[Sequence]:
        """Sample each row's first token from the logits of its prompt's last position (a row of
        `logits` each) and hand the tokens out now; returns the rows that go on to decode (the
        others ended on their first token and leave the prefilling rows)."""
        tokens = sample_batch(logits, [s.sampler for s in seqs]).tolist()
        lp = log_softmax(logits) if any(s.req.sampling.logprobs for s in seqs) else None
        going = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.cache_len = seq.num_prompt
            self._accept(seq, token, lp[i] if lp is not None and seq.req.sampling.logprobs else None)
            if seq.finished:
                self.sched.drop_prefilling(seq)
            else:
                going.append(seq)
        self.flush_events()  # what TTFT waits on: out now, not after this step's decode launch
        return going

    def prefill_group(self, group: list[Sequence], bucket: int) -> None:
        """Whole prompts (but their last token, unless the model samples in prefill; up to its
        checkpoint, for a row with one) of several new rows in one left-padded forward per
        embedding dtype: one forward would run every row in the promoted dtype, and some prompts
        embed wider than the model (float32 image embeddings in a bfloat16 model)."""
        for rows in _by_embedding_dtype(group, lambda seq: seq):
            self._prefill_together(rows, bucket)

    def _prefill_together(self, group: list[Sequence], bucket: int) -> None:
        t0 = time.perf_counter()
        ends = [s.piece_end for s in group]  # a row with a checkpoint stops there
        cache, logits = self.model.prefill_batch([s.prompt for s in group], ends, max(1, bucket))
        self.stats.batched_prefills += 1
        mx.async_eval([c.state for c in cache])
        if self.hooks:
            self.hooks.on_prefill(time.perf_counter() - t0)
        # Rows that stopped at their checkpoint go on in pieces, from caches of their own: their
        # rows of the batch's (all taken before any row counts as prefilled, should one fail).
        stopped = {i for i, (s, end) in enumerate(zip(group, ends)) if end < s.prefill_end}
        own = {i: [layer.extract(i) for layer in cache] for i in stopped}
        for i, caches in own.items():
            group[i].prompt.cache = caches
            mx.async_eval([c.state for c in caches])
        for seq, end in zip(group, ends):
            seq.prefilled = end
        if stopped:
            keep = [i for i in range(len(group)) if i not in stopped]
            if keep:
                index = mx.array(keep, dtype=mx.int32)
                for layer in cache:
                    layer.filter(index)
                logits = logits[index]
            group = [group[i] for i in keep]
        sampling = [i for i, s in enumerate(group) if s.last_in_prefill]
        if sampling:
            going = {id(s) for s in self._first_tokens([group[i] for i in sampling], logits[mx.array(sampling)])}
            keep = [i for i, s in enumerate(group) if not s.last_in_prefill or id(s) in going]
            if len(keep) < len(group):  # rows that ended on their first token never join
                for layer in cache:
                    layer.filter(mx.array(keep, dtype=mx.int32))
                group = [group[i] for i in keep]
        if group:
            self._join(group, cache)

    def _prefix_cache(self, seq: Sequence) -> tuple[PrefixCache | None, Any]:
        """The prefix cache a prompt reads and writes, and its key there (None: none).

        Text-only prompts: the token-keyed cache. Prompts with images: the multimodal one, keyed
        by tokens and image content, where the embedded prompt has the ids' length (a merge
        that changes it would shift every position after an image). Never prompts attended to
        as a whole: a prefix's KV there depends on what follows it. A model whose layers keep
        state beside their KV: only on the pool, where its entries carry that state
        (`PrefixCache.whole_keys`)."""
        prepared = seq.req.prepared
        if self.model.prefix_lm or seq.num_prompt <= 1:
            return None, None
        if not prepared.has_pixels:
            return self.prefix_cache, prepared.prompt_ids
        if self.mm_prefix_cache is None or seq.num_prompt != prepared.num_prompt_tokens:
            return None, None
        key = content_keyed(prepared.prompt_ids, self.model.info.image_token_id, prepared.image_hashes)
        return (self.mm_prefix_cache, key) if key is not None else (None, None)

    def _store_prompt(self, seq: Sequence) -> None:
        """A row that joined: its prompt's KV, now in its blocks, goes into its prefix cache (and
        where the model's layers keep state, that state, as its first step will read it)."""
        store, key = self._prefix_cache(seq)
        if store is None or not seq.blocks or not seq.kv_reusable:
            return
        if store.whole_keys and seq.cache_len != seq.num_prompt - 1:  # its state is past the key's end
            return
        if seq.checkpoint_kept:  # its checkpoint's entry is the one a next turn takes (and a retry too)
            return
        self._keep(seq, store, key[: seq.num_prompt - 1])

    def _store_sequence(self, seq: Sequence) -> None:
        """A finished row's prompt and output KV goes into its prefix cache: a chat's next turn
        sends this very answer back, and finds it computed (as far as its tokens match).

        Where the model's layers keep state, that state goes with it: the state of the last
        step launched, which `cache_len` counts (a step under way when the row finishes fed
        its last token, and counted it)."""
        if self.batch is None or not self.batch.paged or seq not in self.sched.running:
            return
        store, key = self._prefix_cache(seq)
        if store is None or seq.cache_len <= seq.num_prompt or not seq.kv_reusable:
            return
        if seq.checkpoint_kept:  # a next turn's prompt parts from this one before its answer
            return
        ids = np.concatenate([key, np.asarray(seq.output_ids, dtype=key.dtype)])[: seq.cache_len]
        # Steps feed only tokens already out, so the ids cover cache_len; kept as the state's guard.
        if store.whole_keys and len(ids) != seq.cache_len:
            return
        self._keep(seq, store, ids)

    def _keep_checkpoints(self, todo: list[tuple[Sequence, tuple[int, int]]], pool: BlockPool) -> None:
        """Rows whose piece starts at their checkpoint: their KV so far, in `pool` now, and their
        state before this forward (their own caches') go into their prefix cache."""
        for seq, (start, _) in todo:
            if start != seq.checkpoint or not seq.checkpoint or not seq.kv_reusable:
                continue
            store, key = self._prefix_cache(seq)
            if store is None or not store.whole_keys:
                continue
            states = RowStates.of_rows(kv_caches.state_layers(seq.prompt.cache), [0])
            if any(a is None for a in states):
                continue
            self._store(seq, store, key[:start], pool, seq.prefill_blocks, lambda states=states: states)
            seq.checkpoint_kept = store.has(key[:start])

    def _keep(self, seq: Sequence, store: PrefixCache, ids: np.ndarray) -> None:
        """A running row's KV of `ids` (its first positions) into `store`, with the row's state
        where the store's entries carry it."""
        states = (lambda: self.batch.state_of(seq)) if store.whole_keys else (lambda: None)
        self._store(seq, store, ids, self.batch.pool_of(seq), seq.blocks, states)

    @staticmethod
    def _store(
        seq: Sequence, store: PrefixCache, ids, pool: BlockPool, blocks: list[int], states_of: Callable[[], Any]
    ) -> None:
        """`store.store` of a row's KV and its state (`states_of()`: lazy copies, computed only if kept)."""
        try:
            states = states_of()
            if store.store(ids, pool, blocks, states) and states:
                mx.async_eval(states)
        except Exception:  # noqa: BLE001 - a cache entry is never worth a request
            log.warning("keeping request %s's KV for reuse failed", seq.req.request_id, exc_info=True)

    @staticmethod
    def _let_go_of_prefix(seq: Sequence) -> None:
        """The row's hold on the cached prefix it started from, if the join did not take it."""
        if seq.prefix_hit is not None:
            seq.prefix_hit.release()
            seq.prefix_hit = None

    def prefix_caches(self) -> list[PrefixCache]:
        """The prefix caches in use (the image one first)."""
        return [c for c in (self.mm_prefix_cache, self.prefix_cache) if c is not None]

    def _holders_in(self, pool: BlockPool) -> list[tuple[Any, str]]:
        """Every block list in `pool` but the cached prefixes': the running rows' block tables,
        the blocks of prompts prefilling into it and of their prefix hits not joined yet."""
        rows = self.batch.rows_in(pool) if self.batch is not None and self.batch.paged else []
        holders = [(row, "blocks") for row in rows]
        for seq in self.sched.prefilling:
            if seq.prefill_pool is pool:
                holders.append((seq, "prefill_blocks"))
            hit = seq.prefix_hit.shared if seq.prefix_hit is not None else None
            if hit is not None and hit.pool is pool:
                holders.append((hit, "blocks"))
        return holders

    def _cached_holds(self, pool: BlockPool) -> Counter:
        return sum((cache.holds(pool) for cache in self.prefix_caches()), Counter())

    def _renumber_cached(self, pool: BlockPool, mapping: dict[int, int]) -> None:
        for cache in self.prefix_caches():
            cache.renumber(pool, mapping)

    def _evict_cached(self, pool, blocks: int) -> None:
        """Rows need `blocks` free in `pool`: cached prefixes there give way, image ones first."""
        for cache in self.prefix_caches():
            cache.reclaim(pool, blocks)

    def _join(self, seqs: list[Sequence], rows_cache: list[Any] | None) -> None:
        """Prefilled rows enter the running batch; their last prompt token is the next input.
        `rows_cache`: the batch cache their prefill made, or None for rows prefilled into the
        pool (`prefill_blocks`)."""
        for seq in seqs:
            if not seq.last_in_prefill:  # else its cache holds the whole prompt, its first token is out
                seq.cache_len = seq.num_prompt - 1
                seq.last_token = int(seq.req.prepared.prompt_ids[-1])
        if self.batch is None:
            self.batch = self.batches.new()
        rows = None
        dtype = kv_dtype(rows_cache) if rows_cache is not None else seqs[0].prefill_pool.dtype
        if dtype is not None:
            self._kv_dtype_of.update((s.prompt.embeds.dtype, dtype) for s in seqs if s.prompt.embeds is not None)
        if self.budget.bounded:  # a padded batch's rows join one at a time (their caches are not batchable)
            index = {id(s): i for i, s in enumerate(seqs)}
            seqs = self._pay_for_prompts(seqs, dtype, rows_cache, index)
            if not seqs:
                return
            rows = [index[id(s)] for s in seqs]  # each row's place in rows_cache
            if not self.batch.paged:
                self._make_room_for_padding(seqs)
        try:
            if rows_cache is None:  # prefilled into the pool: their blocks join
                self.batch.adopt(seqs)
            else:
                self.batch.join(seqs, rows_cache, rows)
        finally:
            for seq in seqs:  # what the join did not take of their cached prefixes
                self._let_go_of_prefix(seq)
        self.sched.started_decoding(seqs)
        if self.batch.paged:
            for seq in seqs:
                self._store_prompt(seq)
        for seq in seqs:
            self._release_prompt(seq)  # the batch owns the KV now

    @staticmethod
    def _release_prompt(seq: Sequence) -> None:
        """A row's prompt lets go of its device state (its cache, embeddings and extra inputs)."""
        seq.prompt.cache = None
        seq.prompt.embeds = None
        seq.prompt.extra = {}

    def fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        if isinstance(exc, PromptTooLong):  # the request's own fault: no traceback
            log.info("request %s refused: %s", seq.req.request_id, exc)
            self._too_long(seq, str(exc))
            return
        log.error("request %s failed in prefill: %r", seq.req.request_id, exc, exc_info=exc)
        self.sched.drop_prefilling(seq)
        self.finish(seq, FinishReason.ERROR, error=f"prefill failed: {type(exc).__name__}")

    # ---- decode ----------------------------------------------------------------------
    def read_inflight(self) -> None:
        """Hand out the launched decode step's tokens now."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._resolve(prev)

    def decode(self) -> None:
        """Launch this step's batched decode, then read back the previous step's tokens.

        The graph for step N+1 is built from step N's still-unevaluated tokens, so the
        device runs step N+1 while the host detokenizes and emits step N (no per-token sync
        before launching). Rows whose sampling depends on the previous token's value
        (penalties, JSON constraint), and a step holding a request's first token, make the step
        resolve first.
        """
        running = self.sched.running
        prev, self.inflight = self.inflight, None
        if prev is not None and any(s.sampler.needs_history for s in running):
            self._resolve(prev)
            prev = None
        elif prev is not None and any(s is not None and s.generated == 0 for s in prev[0]):
            # It holds a request's first token: hand that out now rather than after launching
            # the next step (a few ms of host time), at the cost of one idle gap on the device.
            # TTFT is what such a request waits on; this happens once per request.
            self._resolve(prev)
            self.flush_events()
            prev = None
        try:
            # Placing the rows' next blocks (a pool that grows, rows preempted to the host) is
            # part of the step: its failure ends the step's rows, not the engine.
            if self.batch is not None and self.budget.bounded and self.sched.running:
                prev = self._grow_blocks(prev)
            if self.sched.running:
                self.inflight = self._launch(prev)
        except Exception as exc:  # a batch-level failure cannot be attributed to one row
            log.exception("decode step failed")
            for seq in list(self.sched.running):
                self.finish(seq, FinishReason.ERROR, error=f"decode failed: {type(exc).__name__}")
            self.sched.remove_running(list(self.sched.running))
            self._drop_batch()
            return
        if prev is not None:
            self._resolve(prev)

    def _launch(self, prev):
        t0 = time.perf_counter()
        rows = self.batch.layout()  # row order of this step; None marks an empty slot
        # Each row's input: its token from the previous (unread) step, or one known on the host
        # (a row that just joined, or every row when the previous step was already read).
        prev_rows, prev_tokens = (prev[0], prev[1]) if prev is not None else ([], None)
        index = {id(s): i for i, s in enumerate(prev_rows) if s is not None}
        host, order = [], []
        for seq in rows:
            if seq is not None and id(seq) in index:
                order.append(index[id(seq)])
            else:
                order.append(len(prev_rows) + len(host))
                host.append(seq.last_token if seq is not None else 0)
        if prev_tokens is None:
            tokens = mx.array(host, dtype=mx.int32)
        else:
            tokens = prev_tokens
            if host:
                tokens = mx.concatenate([tokens, mx.array(host, dtype=mx.int32)])
            if order != list(range(tokens.shape[0])):
                tokens = tokens[mx.array(order, dtype=mx.int32)]
        pieces = self.batch.forward_pieces(tokens, rows)  # one per KV dtype group
        live = [s for s in rows if s is not None]
        samplers = [s.sampler if s is not None else _EMPTY_SLOT_SAMPLER for s in rows]
        next_tokens = _joined([sample_batch(logits, samplers[a:b]) for a, b, logits in pieces])
        lp = (
            _joined([log_softmax(logits) for _, _, logits in pieces])
            if any(s.req.sampling.logprobs for s in live)
            else None
        )
        mx.async_eval(next_tokens, *([lp] if lp is not None else []))
        for seq in live:
            seq.cache_len += 1
        self.stats.decode_steps += 1
        self.host_ms["launch"] += (time.perf_counter() - t0) * 1e3
        return rows, next_tokens, lp, t0

    def _resolve(self, inflight) -> None:
        rows, tokens, lp, t0 = inflight
        ids = tokens.tolist()
        read_at = time.perf_counter()
        live = [(i, s) for i, s in enumerate(rows) if s is not None]
        if self.hooks:
            self.hooks.on_decode_step(time.perf_counter() - t0, len(live))
        for i, seq in live:
            if seq.finished:  # finished or cancelled rows were computed once more; drop that
                continue
            try:
                self._accept(seq, ids[i], lp[i] if lp is not None and seq.req.sampling.logprobs else None)
            except Exception as exc:  # e.g. a token its detokenizer cannot map: that request ends, the rest go on
                log.exception("request %s failed on token %d", seq.req.request_id, ids[i])
                self.finish(seq, FinishReason.ERROR, error=f"decoding the output failed: {type(exc).__name__}")
        self.remove_rows([s for _, s in live if s.finished and s in self.sched.running])
        self.host_ms["resolve"] += (time.perf_counter() - read_at) * 1e3

    def take_host_ms(self) -> dict[str, float]:
        """The host times gathered since the last call (see `host_ms`), which start again from 0."""
        taken, self.host_ms = self.host_ms, dict.fromkeys(self.host_ms, 0.0)
        return taken

    def remove_rows(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        self.sched.remove_running(gone)
        if self.batch is not None:
            self.batch.remove(gone)  # their blocks go back to the pool
        if not self.sched.running:
            self.batch = None

    # ---- KV blocks: growth, preemption, resumption --------------------------------------
    def _weight(self, dtype) -> int:
        """Budget blocks one block of `dtype` KV costs (float32 rows in a bfloat16 model: 2)."""
        weight = self._weights.get(dtype)
        if weight is None and not self.batches.paged:  # a padded batch's rows: counted by row_memory
            weight = self._weights[dtype] = 1
        if weight is None:  # asked for every row at every step: worked out once per dtype
            model_dtype = self.model.kv_layout()[2]
            weight = self._weights[dtype] = max(1, (dtype or model_dtype).size // model_dtype.size)
        return weight

    def _cost(self, tokens: int, dtype) -> int:
        """Budget blocks that a row of `tokens` positions of `dtype` KV costs (with its fixed state)."""
        return self._weight(dtype) * self.budget.blocks_for(tokens) + self.budget.row_blocks

    def _pay_for_prompts(
        self, seqs: list[Sequence], dtype, rows_cache: list[Any] | None, index: dict[int, int]
    ) -> list[Sequence]:
        """Settle what joining rows' blocks cost against what was reserved at admission (the
        embedded length, the KV dtype). A row the budget cannot hold now, even after preempting
        rows that arrived after it, steps aside as a preempted row does and joins when blocks
        free up (`_set_aside`); one it could never hold ends with an error. Returns the rest."""
        ok = []
        for seq in seqs:
            if not self._take_positions(seq, seq.cache_len + 1, dtype):
                if self._never_fits(seq, dtype):
                    self._too_long(seq)
                else:
                    self._set_aside(seq, dtype, rows_cache, index[id(seq)])
                continue
            spare = seq.kv_units - self._cost(seq.cache_len + 1, dtype)
            if spare > 0:  # reserved for more than it holds
                self.budget.give(spare)
                seq.kv_units -= spare
            ok.append(seq)
        return ok

    def _set_aside(self, seq: Sequence, dtype, rows_cache: list[Any] | None, row: int) -> None:
        """A prefilled row steps aside before its join: its KV (row `row` of `rows_cache`, or its
        blocks of the pool it prefilled into) goes to host memory, as a preempted row's does, and
        `resume_preempted` brings it into the batch once the budget holds it."""
        if rows_cache is not None:
            seq.host_kv = self.batch.host_row(rows_cache, row, seq.cache_len)
        else:
            # As `evict` gives a row out: its KV from the pool, its state layers' from its own caches.
            states = self.batch.host_states(seq.prompt.cache)
            seq.host_kv = (seq.prefill_pool.to_host(seq.prefill_blocks, seq.cache_len), states)
            pool_prefill.leave(seq)
        seq.kv_dtype = dtype if dtype is not None or not self.batches.paged else self.model.kv_layout()[2]
        self._let_go_of_prefix(seq)
        self._release_prompt(seq)  # the host copy holds the KV now
        self.sched.preempt(seq)
        log.info(
            "request %s steps aside before joining (%d tokens of KV to host memory): KV blocks ran out",
            seq.req.request_id,
            seq.cache_len,
        )

    def _make_room(self, blocks: int, keep: Sequence) -> bool:
        """Free `blocks` for `keep` by preempting running rows that arrived after it, latest first;
        False (nothing preempted) if that would not free enough."""
        later = [s for s in self.sched.running if s.req.arrival > keep.req.arrival]
        if self.budget.free + sum(s.kv_units for s in later) < blocks:
            return False
        for victim in sorted(later, key=lambda s: s.req.arrival, reverse=True):
            if self.budget.free >= blocks:
                break
            self._preempt(victim)
        return True

    def _make_room_for_padding(self, joining: list[Sequence]) -> None:
        """Before rows join a padded batch: where the padding their join makes (theirs to the
        longest row, the others' to theirs) does not fit, running rows that arrived after them
        step aside first, latest first, while the batch is still narrow (afterwards, taking a
        row out would make the padded caches first). What is still short the next step's growth
        settles, setting aside the rows that arrived last (joining ones among them)."""
        first = min(s.req.arrival for s in joining)
        while True:
            width = max(self._padded_width(), max(s.cache_len for s in joining))
            need = sum(max(0, self._row_growth(s, width)) for s in [*self.sched.running, *joining])
            later = [s for s in self.sched.running if s.req.arrival > first]
            if need <= self.budget.free or not later:
                return
            self._preempt(max(later, key=lambda s: s.req.arrival))

    def _preempt(self, seq: Sequence) -> None:
        seq.host_kv = self.batch.evict(seq)
        self.sched.preempt(seq)
        log.info(
            "preempted request %s (%d tokens of KV to host memory): KV blocks ran out",
            seq.req.request_id,
            seq.cache_len,
        )

    def _growth(self) -> int:
        """Budget blocks the running rows' next positions need beyond what they hold."""
        return sum(self._row_growths())

    def _row_growths(self) -> list[int]:
        """`_row_growth` of each running row, in order, at the batch's width now."""
        width = self._padded_width()
        return [self._row_growth(s, width) for s in self.sched.running]

    def _padded_width(self, joining: Sequence | None = None) -> int:
        """Positions each row of a padded batch holds: mlx_vlm's batch caches left-pad every row
        to the longest one's (with `joining`, as if it had joined). 0 for the paged batches,
        whose rows hold their own positions only."""
        if self.batches.paged:
            return 0
        rows = self.sched.running if joining is None else [*self.sched.running, joining]
        return max((s.cache_len for s in rows), default=0)

    def _row_growth(self, seq: Sequence, width: int = 0) -> int:
        """Budget blocks a row's next position needs beyond what it holds (a padded batch's row
        holds no blocks of its own: what it was counted, and it is counted at the batch's
        `width`, its padding included). Negative where a padded row's batch got narrower."""
        held = (
            self._weight(seq.kv_dtype) * len(seq.blocks) + self.budget.row_blocks
            if self.batches.paged
            else seq.kv_units
        )
        return self._cost(max(seq.cache_len, width) + 1, seq.kv_dtype) - held

    def _grow_blocks(self, prev):
        """Before a step: the block each row's next position needs. When too few are free, the
        previous step is read first (rows may finish) and then the latest rows are preempted; a
        row alone that still cannot grow has reached what the budget holds and ends there."""
        units = self._row_growths()
        if sum(units) > self.budget.free:
            if prev is not None:
                self._resolve(prev)
                prev = None
            while self.sched.running and self._growth() > self.budget.free:
                victim = self.sched.preemption_victim()
                own = self._cost(victim.cache_len + 1, victim.kv_dtype)  # its padding aside
                alone = len(self.sched.running) == 1 and self.budget.used == victim.kv_units
                if alone or own > self.budget.total:  # it could never resume: it is as long as it gets
                    self.finish(victim, FinishReason.LENGTH)
                    self.remove_rows([victim])
                else:
                    self._preempt(victim)
            units = self._row_growths()  # rows went: count again
        if self.sched.running:
            for seq, grown in zip(self.sched.running, units):
                seq.kv_units += grown
            self.budget.take(sum(units))
            self.batch.grow()
        return prev

    def resume_preempted(self) -> None:
        """Preempted rows come back, oldest first, as their blocks fit in the budget."""
        for seq in list(self.sched.preempted):
            cost = self._cost(seq.cache_len + 1, seq.kv_dtype)
            if cost > self.budget.full:  # the budget shrank under it: it ends where it is
                self.sched.drop_preempted(seq)
                self.finish(seq, FinishReason.LENGTH)
                continue
            if cost > self.budget.total:  # it fits once what is lent comes back: it waits for that
                return
            # Room for the running rows' next blocks too: else the row that just came back, the
            # latest arrival, is the first put aside again at the next step's growth. In a padded
            # batch that is its padding to the longest row, and theirs to it.
            if self.batches.paged:
                headroom = sum(self._weight(s.kv_dtype) for s in self.sched.running)
            else:
                width = self._padded_width(joining=seq)
                padding = self._cost(max(seq.cache_len, width) + 1, seq.kv_dtype) - cost
                headroom = padding + sum(max(0, self._row_growth(s, width)) for s in self.sched.running)
            if cost + headroom > self.budget.free and self.sched.running:
                return
            if not self.budget.take(cost):
                return
            seq.kv_units = cost
            if self.batch is None:
                self.batch = self.batches.new()
            try:
                self.batch.resume(seq, seq.host_kv)
            except Exception as exc:  # its KV could not come back: it ends, the others go on
                log.exception("resuming request %s failed", seq.req.request_id)
                self.sched.drop_preempted(seq)  # and what the budget took for it
                self.finish(seq, FinishReason.ERROR, error=f"resuming failed: {type(exc).__name__}")
                continue
            seq.host_kv = None
            self.sched.resumed(seq)
            log.info("resumed request %s at %d tokens", seq.req.request_id, seq.cache_len)

    def _drop_batch(self) -> None:
        """Forget the running batch and every pool, with the prefixes cached there (rows
        prefilling into a pool go on in their own caches)."""
        for seq in self.sched.prefilling:
            if seq.prefill_pool is not None:
                pool_prefill.back_to_own_cache(seq)
            self._let_go_of_prefix(seq)  # its own cache holds the prefix too
        self.batch = None
        for pool in self.batches.pools.values():
            for cache in self.prefix_caches():
                cache.forget(pool)
        self.batches.pools.clear()

    def piece_lengths_to_warm(self) -> list[int]:
        """The padded lengths a lone prompt's piece past a chunk can take, from where
        `warm_piece_length` starts its piece."""
        return self.sched.lone_piece_lengths(self._warm_head(), self.context_length)

    def _warm_head(self) -> int:
        return max(1, self.sched.prefill_bucket)  # the throwaway prompt's prefix before its piece

    def warm_piece_length(self, length: int, filler: int) -> None:
        """Prefill a throwaway text prompt's piece of `length` positions (a padded length) after a
        short prefix, by the pieces forward: on CUDA a padded length's first run pays for
        per-shape setup (tens of ms) that later runs skip."""
        head = self._warm_head()
        state = self.model.embed_prompts([PreparedRequest(prompt_ids=np.full(head + length + 1, filler, np.int32))])[0]
        self.model.prefill(state, 0, head)
        self.model.prefill_pieces([state], [(head, head + length)], length)
        mx.eval([c.state for c in state.cache])

    def release_memory(self) -> None:
        """Idle: hand the block pools back, but for the blocks cached prefixes hold."""
        if self.batch is None or not self.batch.layout():
            self.batch = None
            for pool, mapping in self.batches.release():
                self._renumber_cached(pool, mapping)

    # ---- per-token bookkeeping ---------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, logprobs: mx.array | None) -> None:
        seq.generated += 1
        seq.output_ids.append(token)
        seq.sampler.observe(token)
        if seq.sampler.logits_mask is not None:
            seq.sampler.logits_mask.consume(token)
        seq.last_token = token
        params = seq.req.sampling
        event = TokenEvent(token_ids=[token])
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, event=event)
            return
        if logprobs is not None:
            event.logprobs.append(self._logprob_entry(token, logprobs, params.top_logprobs))
        event.text = seq.text.add(token)
        if seq.text.stopped:
            self.finish(seq, FinishReason.STOP, event=event)
        # The prompt and its tokens fill the context: counted, not read from cache_len, which
        # already holds the position of a decode step launched ahead of this token's.
        elif seq.generated >= params.max_tokens or seq.num_prompt + seq.generated >= self.context_length:
            self.finish(seq, FinishReason.LENGTH, event=event)
        else:
            seq.req.emit(event)

    def _logprob_entry(self, token: int, logprobs: mx.array, top_n: int) -> TokenLogprob:
        top: list[TopLogprob] = []
        if top_n > 0:
            idx = mx.argpartition(-logprobs, top_n - 1)[:top_n]
            vals = logprobs[idx]
            order = mx.argsort(-vals)
            for tid, val in zip(idx[order].tolist(), vals[order].tolist()):
                top.append(TopLogprob(tid, self.tokenizer.token_text(tid), float(val)))
        return TokenLogprob(token, self.tokenizer.token_text(token), float(logprobs[token].item()), top)

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        event: TokenEvent | None = None,
        error: str | None = None,
        error_code: str | None = None,
    ) -> None:
        if seq.finished:
            return
        seq.finished = True
        self._let_go_of_prefix(seq)  # it may end before joining
        pool_prefill.leave(seq)
        event = event or TokenEvent()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            event.text += seq.text.finish()
            self._store_sequence(seq)
        event.finish_reason = reason
        event.error = error
        event.error_code = error_code
        event.prompt_tokens = seq.num_prompt
        event.cached_tokens = seq.cached_tokens
        event.completion_tokens = seq.generated
        seq.req.emit(event)

    def drop_all(self) -> None:
        """Forget every row's device state (after the scheduler's queues were emptied)."""
        self._drop_batch()
        self.inflight = None
