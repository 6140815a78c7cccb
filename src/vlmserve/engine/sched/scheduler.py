"""MLLMScheduler: continuous batching on the MLX worker thread.

Each `step()`: drop cancelled requests, admit waiting ones (up to max_num_seqs), advance
prefill by at most one chunk's worth of tokens, then run ONE batched decode step for all
running rows. A request arriving mid-decode starts its prefill on the next step.
Every request owns its sampler, PRNG key, stop strings, position state and KV cache; it
joins the shared batch cache only once its prompt is in.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from vlmserve.engine.runner.decode_batch import DecodeBatches
from vlmserve.engine.runner.prefix_cache import PrefixCache
from vlmserve.engine.runner.sampling import RowSampler, log_softmax, sample_batch
from vlmserve.engine.runner.text_stream import TextStream
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.models.generic import VLM, PromptState, image_grids
from vlmserve.protocol import FinishReason, PreparedRequest, SamplingParams, TokenEvent, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

_EMPTY_SLOT_SAMPLER = RowSampler(params=SamplingParams(temperature=0.0))  # rows nobody owns: cheapest draw


@dataclass(eq=False)  # identity semantics: rows are found in lists by `is`, never by value
class EngineRequest:
    """What the API side hands to the engine; `emit` delivers events (called on the worker)."""

    request_id: str
    prepared: PreparedRequest
    sampling: SamplingParams
    emit: Callable[[TokenEvent], None]
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set from any thread; read by the worker at its next step
    staged_inputs: Any = None  # its arrays already copied into MLX (MLLMScheduler._stage_upcoming)


@dataclass(eq=False)
class Sequence:
    req: EngineRequest
    sampler: RowSampler
    text: TextStream
    prompt: PromptState | None = None
    prefilled: int = 0
    cached_tokens: int = 0
    cache_len: int = 0
    last_token: int = -1
    generated: int = 0
    finished: bool = False

    @property
    def num_prompt(self) -> int:
        return self.req.prepared.num_prompt_tokens


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    batched_prefills: int = 0  # forwards that prefilled several requests at once


class MLLMScheduler:
    def __init__(
        self,
        vlm: VLM,
        tokenizer: TextCodec,
        *,
        max_num_seqs: int = 32,
        prefill_chunk: int = 512,
        prefill_budget: int | None = None,
        prefill_bucket: int = 0,
        prefix_cache_tokens: int = 65536,
        compile_decode: bool = False,
        idle_release_s: float = 60.0,
        hooks: Any = None,
    ):
        self.vlm = vlm
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget or prefill_chunk  # prompt tokens per step, all requests
        self.prefill_bucket = prefill_bucket  # pad prompt lengths to multiples of this (0: exact shapes)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.eos = set(vlm.info.eos_token_ids) | set(tokenizer.eos_token_ids)
        self.context_length = vlm.info.context_length
        self.hooks = hooks
        self.idle_release_s = idle_release_s  # idle this long before MLX's buffer cache is handed back
        self.inbox: deque[EngineRequest] = deque()  # appended from any thread
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.batch = None  # the running rows' KV caches (decode_batch.py); None while nothing runs
        self.batches = DecodeBatches(vlm, compile_decode)
        self.stats = SchedulerStats()
        self._json_factory = None
        self._inflight = None  # (rows, tokens, logprobs, t0) of the launched, unread decode step
        self._idle_since: float | None = None  # when the last step ran out of work (None: busy, or released)
        self.flush_events: Callable[[], None] = lambda: None  # hands emitted events over now (the engine's)

    # ---- called from any thread ------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.inbox.append(req)

    # ---- worker thread ---------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.inbox)

    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self.prefilling or self.running or self._inflight)

    def step(self) -> None:
        self.stats.steps += 1
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        if self._inflight is not None and self.prefilling:
            # Prefill holds this thread for a while (vision, embeddings, forward): hand out the
            # previous decode step's tokens first, not after it (the first tokens of the group
            # admitted one step earlier would otherwise wait for this step's group).
            prev, self._inflight = self._inflight, None
            self._resolve(prev)
            self.flush_events()
        self._prefill()
        self._stage_upcoming()
        self._decode()
        self._idle_since = None if self.has_work() else time.monotonic()

    def release_idle_memory(self) -> None:
        """Hand MLX's cached buffers back once idle for `idle_release_s` (other processes share the device).

        Not as soon as work runs out: freeing the pool holds the GIL for tens of ms (an event
        loop stall), and the next request allocates every buffer again: on the H100 a request
        after a release took 100-160 ms to its first token against 50-65 ms without.
        """
        if self._idle_since is not None and time.monotonic() - self._idle_since >= self.idle_release_s:
            self._idle_since = None
            mx.clear_cache()

    def fail_all(self, message: str) -> None:
        """Wake every waiter with an error (worker death or shutdown)."""
        self._take_inbox()
        for req in self.waiting:
            req.emit(TokenEvent(finish_reason=FinishReason.ERROR, error=message))
        for seq in self.prefilling + self.running:
            self._finish(seq, FinishReason.ERROR, error=message)
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        self.batch = None
        self._inflight = None

    # ---- phases ------------------------------------------------------------------
    def _take_inbox(self) -> None:
        """Requests handed over from other threads join the waiting queue, in arrival order."""
        while self.inbox:
            self.waiting.append(self.inbox.popleft())

    def _step_tokens(self, remaining: int) -> int:
        """What a prompt with `remaining` tokens to prefill counts against a step's budget."""
        return max(1, min(remaining, self.prefill_chunk))

    def _unembedded_in_budget(self) -> tuple[list[Sequence], int]:
        """The prefilling prompts not yet embedded that the next prefill's budget reaches (in
        order, each counted at most a chunk, embedded ones too), and the budget left after all."""
        budget, todo = self.prefill_budget, []
        for seq in self.prefilling:
            if budget <= 0:
                break
            if seq.prompt is None:
                todo.append(seq)
            budget -= self._step_tokens(seq.num_prompt - 1 - seq.prefilled)
        return todo, budget

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.emit(TokenEvent(finish_reason=FinishReason.ABORT))
        for seq in [s for s in self.prefilling if s.req.cancelled]:
            self.prefilling.remove(seq)
            self._finish(seq, FinishReason.ABORT)
        gone = [s for s in self.running if s.req.cancelled]
        for seq in gone:
            self._finish(seq, FinishReason.ABORT)
        self._remove_rows(gone)

    def _admit(self) -> None:
        while self.waiting and self.num_running < self.max_num_seqs:
            req = self.waiting.popleft()
            try:  # a request the sampler cannot take (e.g. a seed out of range) ends only itself
                sampler = RowSampler.create(req.sampling)
                if req.sampling.json_mode:
                    sampler.logits_mask = self._json_constraints().new()
                text = TextStream(self.tokenizer.new_detokenizer(), req.sampling.stop)
            except Exception as exc:
                log.exception("request %s failed at admission", req.request_id)
                req.emit(TokenEvent(finish_reason=FinishReason.ERROR, error=f"admission failed: {type(exc).__name__}"))
                continue
            self.prefilling.append(Sequence(req=req, sampler=sampler, text=text))
            if self.hooks:
                self.hooks.on_admit(req)

    def _json_constraints(self):
        if self._json_factory is None:
            from vlmserve.engine.runner.json_mode import JsonConstraintFactory

            self._json_factory = JsonConstraintFactory(self.tokenizer.hf, self.vlm.info.vocab_size, sorted(self.eos))
        return self._json_factory

    def _prefill(self) -> None:
        """Spend at most the step's prefill budget, oldest request first.

        New prompts that fit whole go into one left-padded batched forward (one launch for
        several requests); a long prompt is prefilled alone, one chunk per step.
        """
        self._embed_upcoming()
        budget = self.prefill_budget
        group: list[Sequence] = []
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            try:
                self._embed(seq)
                remaining = seq.num_prompt - 1 - seq.prefilled
                if self._batchable(seq) and remaining <= min(budget, self.prefill_chunk):
                    group.append(seq)
                    budget -= remaining
                else:
                    budget -= self._prefill_one(seq, min(budget, self.prefill_chunk))
            except Exception as exc:  # one bad request ends only itself
                self._fail_prefill([seq], exc)
        if len(group) == 1 and self.prefill_bucket <= 1:  # alone: exactly mlx_vlm.generate's shapes
            try:
                self._prefill_one(group[0], self.prefill_chunk)
            except Exception as exc:
                self._fail_prefill(group, exc)
        elif group:
            try:
                self._prefill_group(group)
            except Exception as exc:  # the batched forward failed: those requests end, others go on
                self._fail_prefill(group, exc)

    def _fail_prefill(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            log.error("request %s failed in prefill: %r", seq.req.request_id, exc, exc_info=exc)
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            self._finish(seq, FinishReason.ERROR, error=f"prefill failed: {type(exc).__name__}")

    def _embed_upcoming(self) -> None:
        """Embed, in one call, the new requests this step's prefill budget will reach, so their
        images go through the vision tower together. If that batch fails, each request is
        embedded alone later (by `_embed`) and only a bad one ends."""
        todo, _ = self._unembedded_in_budget()
        if len(todo) < 2:
            return
        t0 = time.perf_counter()
        try:
            prompts = self.vlm.embed_prompts([s.req.prepared for s in todo], [s.req.staged_inputs for s in todo])
        except Exception:
            log.warning("batched embedding of %d requests failed; embedding them one by one", len(todo), exc_info=True)
            return
        share = (time.perf_counter() - t0) / len(todo)
        for seq, prompt in zip(todo, prompts):
            self._embedded(seq, prompt, share)

    def _stage_upcoming(self) -> None:
        """Copy the pixels of the requests the next step will embed into MLX now.

        Those copies are host work. Done at the next step's start, the device idles through
        them (W1 on the H100: ~1.3 ms per request, ~25 ms before a group's vision tower could
        start). Here they overlap the prefill just launched (its last command buffers are still
        queued: async_eval returns that far ahead), or the decode step running meanwhile. As
        many requests as the next step's prefill budget reaches are staged; a failure leaves
        the copy to the embedding, where it ends only that request."""
        self._take_inbox()
        todo, budget = self._unembedded_in_budget()
        upcoming = [s.req for s in todo]
        for req in list(self.waiting)[: max(0, self.max_num_seqs - self.num_running)]:  # admitted next, after these
            if budget <= 0:
                break
            upcoming.append(req)
            budget -= self._step_tokens(req.prepared.num_prompt_tokens - 1)
        for req in upcoming:
            if req.staged_inputs is None and req.prepared.has_pixels and not req.cancelled:
                try:
                    req.staged_inputs = self.vlm.stage_inputs(req.prepared)
                except Exception:  # noqa: BLE001 - embedding copies again and reports it
                    log.warning("staging request %s failed", req.request_id, exc_info=True)

    def warm_vision(self, prepared: PreparedRequest) -> int:
        """`warm_vision_plans` for each image size of this request; returns the tower runs made."""
        return sum(len(self.warm_vision_plans(tuple(grid))) for grid in image_grids(prepared).tolist())

    def warm_vision_plans(self, grid_thw: tuple[int, int, int]) -> list[int]:
        """Build the tower's shapes for images of this grid at every count `_embed_upcoming` can
        batch: requests are taken until the budget is spent, each counted at most a chunk."""
        per_image = self._step_tokens(self.vlm.image_tokens(grid_thw))
        return self.vlm.warm_vision_plans(grid_thw, min(self.max_num_seqs, self.prefill_budget // per_image + 1))

    def _embed(self, seq: Sequence) -> None:
        """Vision encoder + embeddings (once per request), and the prefix cache for text-only prompts."""
        if seq.prompt is None:
            t0 = time.perf_counter()
            prompt = self.vlm.embed_prompts([seq.req.prepared], [seq.req.staged_inputs])[0]
            self._embedded(seq, prompt, time.perf_counter() - t0)

    def _embedded(self, seq: Sequence, prompt: PromptState, seconds: float) -> None:
        prepared = seq.req.prepared
        seq.prompt = prompt
        seq.req.staged_inputs = None  # the prompt holds what it needs of them
        if self.prefix_cache is not None and not prepared.has_pixels:
            seq.prefilled = seq.cached_tokens = self.prefix_cache.lookup(prepared.prompt_ids, prompt.cache)
            if self.hooks:
                self.hooks.on_prefix_lookup(seq.cached_tokens > 0)
        mx.async_eval(prompt.embeds)
        if self.hooks and prepared.has_pixels:
            self.hooks.on_vision(seconds)

    def _batchable(self, seq: Sequence) -> bool:
        return seq.prefilled == 0 and seq.num_prompt > 1 and PrefixCache.supports(seq.prompt.cache)

    def _prefill_one(self, seq: Sequence, budget: int) -> int:
        """Prefill prompt[:-1] in chunks; the last prompt token then rides the next batched
        decode step, which samples the first token. This is how mlx_vlm.generate splits the
        prompt too (chunks, then the last token alone), and it saves one forward per request."""
        target = seq.num_prompt - 1
        end = min(target, seq.prefilled + budget)
        used = end - seq.prefilled
        if used > 0:
            t0 = time.perf_counter()
            self.vlm.prefill(seq.prompt, seq.prefilled, end)
            # Queue it and move on: the device runs it between decode steps, no host stall.
            mx.async_eval([c.state for c in seq.prompt.cache])
            seq.prefilled = end
            if self.hooks:
                self.hooks.on_prefill(time.perf_counter() - t0)
        if end < target:
            return used
        self._store_prefix(seq, seq.prompt.cache)
        self._join([seq], self.vlm.merge_caches([seq.prompt.cache]))
        return used

    def _prefill_group(self, group: list[Sequence]) -> None:
        t0 = time.perf_counter()
        cache = self.vlm.prefill_batch(
            [s.prompt for s in group], [s.num_prompt - 1 for s in group], max(1, self.prefill_bucket)
        )
        self.stats.batched_prefills += 1
        mx.async_eval([c.state for c in cache])
        if self.hooks:
            self.hooks.on_prefill(time.perf_counter() - t0)
        for i, seq in enumerate(group):
            seq.prefilled = seq.num_prompt - 1
            if self._caches_prefix(seq):  # extract() syncs: only when the row will be stored
                self._store_prefix(seq, [layer.extract(i) for layer in cache])
        self._join(group, cache)

    def _caches_prefix(self, seq: Sequence) -> bool:
        """Invariant 6: only text-only prompts enter the prefix cache."""
        return self.prefix_cache is not None and not seq.req.prepared.has_pixels and seq.num_prompt > 1

    def _store_prefix(self, seq: Sequence, cache: list[Any]) -> None:
        if self._caches_prefix(seq):
            self.prefix_cache.store(seq.req.prepared.prompt_ids[: seq.num_prompt - 1], cache)

    def _join(self, seqs: list[Sequence], rows_cache: list[Any]) -> None:
        """Prefilled rows enter the running batch; their last prompt token is the next input."""
        for seq in seqs:
            seq.cache_len = seq.num_prompt - 1
            seq.last_token = int(seq.req.prepared.prompt_ids[-1])
        if self.batch is None:
            self.batch = self.batches.new()
        self.batch.join(seqs, rows_cache)
        for seq in seqs:
            self.prefilling.remove(seq)
            seq.prompt.cache = None  # the batch owns the KV now
            seq.prompt.embeds = None
            self.running.append(seq)

    def _decode(self) -> None:
        """Launch this step's batched decode, then read back the previous step's tokens.

        The graph for step N+1 is built from step N's still-unevaluated tokens, so the
        device runs step N+1 while the host detokenizes and emits step N (no per-token sync
        before launching). Rows whose sampling depends on the previous token's value
        (penalties, JSON constraint), and a step holding a request's first token, make the step
        resolve first.
        """
        prev, self._inflight = self._inflight, None
        if prev is not None and any(s.sampler.needs_history for s in self.running):
            self._resolve(prev)
            prev = None
        elif prev is not None and any(s is not None and s.generated == 0 for s in prev[0]):
            # It holds a request's first token: hand that out now rather than after launching
            # the next step (~5 ms of host time on the H100), at the cost of one idle gap on the
            # device. TTFT is what such a request waits on; this happens once per request.
            self._resolve(prev)
            self.flush_events()
            prev = None
        if self.running:
            try:
                self._inflight = self._launch(prev)
            except Exception as exc:  # a batch-level failure cannot be attributed to one row
                log.exception("decode step failed")
                for seq in list(self.running):
                    self._finish(seq, FinishReason.ERROR, error=f"decode failed: {type(exc).__name__}")
                self.running.clear()
                self.batch = None
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
        logits = self.batch.forward(tokens, rows)
        live = [s for s in rows if s is not None]
        next_tokens = sample_batch(logits, [s.sampler if s is not None else _EMPTY_SLOT_SAMPLER for s in rows])
        lp = log_softmax(logits) if any(s.req.sampling.logprobs for s in live) else None
        mx.async_eval(next_tokens, *([lp] if lp is not None else []))
        for seq in live:
            seq.cache_len += 1
        self.stats.decode_steps += 1
        return rows, next_tokens, lp, t0

    def _resolve(self, inflight) -> None:
        rows, tokens, lp, t0 = inflight
        ids = tokens.tolist()
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
                self._finish(seq, FinishReason.ERROR, error=f"decoding the output failed: {type(exc).__name__}")
        self._remove_rows([s for _, s in live if s.finished and s in self.running])

    # ---- per-token bookkeeping -------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, logprobs: mx.array | None) -> None:
        seq.generated += 1
        seq.sampler.observe(token)
        if seq.sampler.logits_mask is not None:
            seq.sampler.logits_mask.consume(token)
        seq.last_token = token
        params = seq.req.sampling
        event = TokenEvent(token_ids=[token])
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP, event=event)
            return
        if logprobs is not None:
            event.logprobs.append(self._logprob_entry(token, logprobs, params.top_logprobs))
        event.text = seq.text.add(token)
        if seq.text.stopped:
            self._finish(seq, FinishReason.STOP, event=event)
        elif seq.generated >= params.max_tokens or seq.cache_len + 1 >= self.context_length:
            self._finish(seq, FinishReason.LENGTH, event=event)
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

    def _finish(
        self, seq: Sequence, reason: FinishReason, *, event: TokenEvent | None = None, error: str | None = None
    ) -> None:
        if seq.finished:
            return
        seq.finished = True
        event = event or TokenEvent()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            event.text += seq.text.finish()
        event.finish_reason = reason
        event.error = error
        event.prompt_tokens = seq.num_prompt
        event.cached_tokens = seq.cached_tokens
        event.completion_tokens = seq.generated
        seq.req.emit(event)

    def _remove_rows(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        self.running = [s for s in self.running if s not in gone]
        if not self.running:
            self.batch = None
        elif self.batch is not None:
            self.batch.remove(gone)
