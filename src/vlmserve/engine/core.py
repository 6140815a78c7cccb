"""EngineCore: the model, the scheduler and the runner, stepped on the MLX worker thread.

Each `step()`: drop cancelled requests, admit waiting ones (up to max_num_seqs), spend the
step's prefill budget, stage the next step's inputs, then run ONE batched decode step for
all running rows. The scheduler (sched/) decides each phase; the runner (runner/) carries it
out. Warm-up, which builds the shapes traffic will use before the server reports ready, is
the core's job too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from vlmserve.config import ServerConfig
from vlmserve.engine.memory import StepMemoryBound, kv_budget_bytes, wire_memory, working_memory_bytes
from vlmserve.engine.ops import kernel_disk_cache, many_row_dequantized
from vlmserve.engine.ops.cuda_kernels import on_cuda
from vlmserve.engine.runner.block_pool import kv_block_bytes
from vlmserve.engine.runner.decode_batch import ROW_BUCKETS, pages_kv, round_up
from vlmserve.engine.runner.model_runner import PIECES_MAX_PAIRS, ModelRunner
from vlmserve.engine.runner.prefix_cache import state_limit_bytes
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.engine.sched.request import EngineRequest, Sequence
from vlmserve.engine.sched.scheduler import TOO_LONG, PrefillPlan, PromptTooLong, Scheduler
from vlmserve.engine.step_trace import StepTrace
from vlmserve.models.feature_cache import FeatureCache
from vlmserve.models.registry import load_model_adapter
from vlmserve.protocol import CacheGauges, FinishReason, PreparedRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

WARM_SLOTS = 32  # warm-up traces decode steps of up to this many rows
# Where attention gathers each row's KV (no kernel reads the pool: Metal, CPU, CUDA without
# vlmserve's kernels), the decode step's shape depends on the longest row: idle time traces the
# widths rows of up to this many positions take.
IDLE_WIDTH_TOKENS = 8192
# Decode shapes compiled one after another log a line at most this often (and the last, and any
# slow one): a start's tens of them would pass the log's repeat limit and seem to stop halfway.
SHAPE_LOG_S = 2.0
SIDE_BUILD_WAIT_S = 20.0  # warm-up waits at most this long for the kernels side processes build

_WARMUP_SAMPLING = SamplingParams(max_tokens=2, temperature=0)
SLOW_STEP_S = 1.0  # a step at least this long is logged with what it ran
IDLE_PIECE_MAX_S = 0.25  # idle warm-up runs no prompt piece longer than this (an arriving request waits)


def state_reserve_bytes(model, max_num_seqs: int) -> int:
    """Bytes the state layers' state takes at `max_num_seqs` running rows (0 for a model whose
    layers are all KV): a row per decode slot, the row bucket that many rows fill."""
    layout = model.state_layout() if pages_kv(model) else None
    if layout is None or all(arrays is None for arrays in layout):
        return 0
    row = sum(math.prod(shape) * dtype.size for arrays in layout if arrays for shape, dtype in arrays)
    return row * round_up(max_num_seqs, ROW_BUCKETS)


def _pixel_shapes(prepared: PreparedRequest) -> list[tuple[int, ...]]:
    """The shapes of a request's pixel inputs (what sizes its images reached the vision tower at)."""
    return [tuple(v.shape) for k, v in prepared.model_inputs.items() if k.startswith("pixel_values")]


class EngineCore:
    def __init__(
        self,
        model,
        tokenizer: TextCodec,
        *,
        max_num_seqs: int = 32,
        prefill_chunk: int = 512,
        prefill_budget: int | None = None,
        prefill_bucket: int = 0,
        prefix_cache_tokens: int = 65536,
        mm_cache: bool = False,
        compile_decode: bool = False,
        idle_release_s: float = 60.0,
        kv_budget: KVBudget | None = None,
        working_memory: int | None = None,
        hooks: Any = None,
    ):
        self.model = model
        # What a step may hold beyond the memory in use when it starts (None: MLX's own limit).
        self._step_memory = StepMemoryBound(working_memory) if working_memory else None
        self._trace = StepTrace.from_env()  # VLMSERVE_STEP_TRACE: a profile of every step (step_trace.py)
        self.tokenizer = tokenizer
        self.hooks = hooks
        self.sched = Scheduler(
            max_num_seqs=max_num_seqs,
            prefill_chunk=prefill_chunk,
            prefill_budget=prefill_budget,
            prefill_bucket=prefill_bucket,
            kv_budget=kv_budget,
            lone_pairs=PIECES_MAX_PAIRS,  # a lone prompt's forward: the runner's bound on prompt attention
        )
        self.runner = ModelRunner(
            model,
            tokenizer,
            self.sched,
            prefix_cache_tokens=prefix_cache_tokens,
            mm_cache=mm_cache,
            compile_decode=compile_decode,
            # A pool that grows changes the decode step's shapes, whose first runs build GPU
            # kernels: start with room for every row at two prefill chunks, as warm-up assumes.
            initial_pool_tokens=max_num_seqs * 2 * prefill_chunk,
            hooks=hooks,
        )
        self.stats = self.runner.stats
        # What preprocessing needs to know of the prefix caches: whether they reuse whole prompts only.
        self.model.info.whole_prefixes = any(c.whole_keys for c in self.runner.prefix_caches())
        self.idle_release_s = idle_release_s  # idle this long before MLX's buffer cache is handed back
        self._idle_since: float | None = None  # when the last step ran out of work (None: busy, or released)
        self._memory: dict[str, int] = {}  # MLX's memory figures, read on the worker (step_memory)
        self._memory_read = 0.0
        self._peak_noted = 0  # the highest MLX peak logged (_note_peak)
        self._kernel_seconds = 0.0
        self.kernel_builds = None  # MLX kernels built by side processes, taken when done (kernel_prebuild.Background)
        self.indexing_builds = None  # MLX's indexing kernels building in side processes (indexing_prebuild)
        self.rehearsal = None  # MLX's fused kernels compiling in a side process; uncompiled until it ends
        # Decode shapes to compile (warm-up's end): (rows, table width) on the model dtype's pool,
        # (rows, width, dtype) on another KV dtype's (prompts that embed wider than the model).
        self._shapes_to_warm: list[tuple] = []
        self._warm_shapes: list[tuple] = []  # all of them, traced again when kernels change
        self._shape_logged = 0.0  # when a compiled decode shape was last logged (SHAPE_LOG_S)
        self._kernels_filed = False  # the builds queued at load were waited for (_build_kernel)
        self._decode_builds_noted = False  # note_decode_builds ran
        self._lengths_to_warm: list[int] = []  # lone prompts' piece lengths past a chunk, run while idle
        self._filler_token = 0
        self._warmed = False  # warm_up ran: idle work may then build what only requests use (grammars)
        # Warm-up is on its way (the engine's config asks for one): idle work waits for it, since
        # it starts by waiting for the kernel builds queued at load, and warm-up need not.
        self.warm_up_due = False

    @classmethod
    def load(
        cls,
        config: ServerConfig,
        model_path: Path,
        model_type: str,
        tokenizer: TextCodec,
        hooks: Any = None,
        before_first_forward: Callable[[], object] | None = None,
    ) -> EngineCore:
        """Load the model behind its family's adapter and build the core (on the worker thread);
        `before_first_forward` runs between reading the weights and the load's first forward."""
        mx.set_cache_limit(int(config.mlx_cache_limit_gb * (1 << 30)))
        log.info("loading weights: %s (%s)", model_path, model_type)
        t0 = time.perf_counter()
        model = load_model_adapter(model_path, model_type, tokenizer.eos_token_ids, before_first_forward)
        log.info(
            "loaded weights in %.1f s: %.2f GB on the device", time.perf_counter() - t0, mx.get_active_memory() / 1e9
        )
        wire_memory(mx.get_active_memory())
        if config.max_model_len:
            model.info.context_length = min(model.info.context_length, config.max_model_len)
        max_num_seqs = config.max_num_seqs
        if not model.can_batch and max_num_seqs > 1:
            log.warning(
                "%s: its KV caches cannot be batched yet; serving one request at a time (--max-num-seqs 1)",
                model.info.model_type,
            )
            max_num_seqs = 1
        compile_decode = config.compile_decode == "on" or (
            config.compile_decode == "auto" and mx.default_device() == mx.gpu
        )
        budget = cls.kv_budget(model, config)
        if config.mm_cache:
            model.feature_cache = FeatureCache(int(config.mm_feature_cache_gb * (1 << 30)))
        model.info.context_length = min(model.info.context_length, budget.max_tokens)
        return cls(
            model,
            tokenizer,
            max_num_seqs=max_num_seqs,
            prefill_chunk=config.prefill_chunk,
            prefill_budget=config.prefill_token_budget,
            prefill_bucket=config.prefill_bucket,
            prefix_cache_tokens=config.prefix_cache_tokens,
            mm_cache=config.mm_cache,
            compile_decode=compile_decode,
            idle_release_s=config.release_cache_after_idle_s,
            kv_budget=budget,
            working_memory=working_memory_bytes(config.working_memory_gb),
            hooks=hooks,
        )

    @staticmethod
    def kv_budget(model, config: ServerConfig) -> KVBudget:
        """The KV budget in blocks, from --kv-cache-memory or --gpu-memory-utilization."""
        budget = kv_budget_bytes(config.kv_cache_memory_gb, config.gpu_memory_utilization)
        if not pages_kv(model):
            return EngineCore._padded_budget(model, config, budget)
        block_bytes = kv_block_bytes(model, config.kv_block_size)
        # Layers of fixed-size state keep it a row per decode slot beside the pool (RowStates): that
        # of every slot a full batch takes comes off the budget first.
        states = state_reserve_bytes(model, config.max_num_seqs)
        # And the states cached prefixes keep at their ends (outside the pool, prefix_cache.py).
        cached = state_limit_bytes(max(0, config.prefix_cache_tokens), kv_block_bytes(model, 1)) if states else 0
        if states and budget - states - cached < block_bytes:
            raise ValueError(
                f"the KV budget ({budget / 1e9:.2f} GB) does not hold the recurrent or convolution state "
                f"of --max-num-seqs {config.max_num_seqs} rows ({states / 1e9:.2f} GB), that of cached "
                f"prefixes ({cached / 1e9:.2f} GB) and a block of KV: raise --kv-cache-memory or "
                "--gpu-memory-utilization, or lower --max-num-seqs or --prefix-cache-tokens"
            )
        blocks = max(1, (budget - states - cached) // block_bytes)
        log.info(
            "KV budget: %.2f GB, %d blocks of %d positions (%d tokens)%s%s",
            blocks * block_bytes / 1e9,
            blocks,
            config.kv_block_size,
            blocks * config.kv_block_size,
            f", and {states / 1e9:.2f} GB for the state of {config.max_num_seqs} rows" if states else "",
            f", {cached / 1e9:.2f} GB for cached prefixes' states" if cached else "",
        )
        return KVBudget(blocks, config.kv_block_size)

    @staticmethod
    def _padded_budget(model, config: ServerConfig, budget: int) -> KVBudget:
        """The budget of a model whose caches are not paged (one padded batch): each row counted
        at its positions' bytes plus its fixed state (a recurrent or convolution state); the
        runner counts a running row's positions at the batch's width, its padding up to the
        longest row included."""
        memory = model.row_memory()
        if memory is None:
            log.info("KV budget: none (this model's caches are neither paged nor of kinds it can count)")
            return KVBudget.unbounded(config.kv_block_size)
        per_position, fixed = memory
        block_bytes = max(1, per_position * config.kv_block_size)
        blocks = max(1, budget // block_bytes)
        row_blocks = -(-fixed // block_bytes)
        if row_blocks >= blocks:
            log.warning("KV budget: none (%.2f GB holds no row's fixed state and a position)", budget / 1e9)
            return KVBudget.unbounded(config.kv_block_size)
        log.info(
            "KV budget: %.2f GB, %d blocks of %d positions, %d a row for its fixed state (caches not paged: "
            "one padded batch)",
            blocks * block_bytes / 1e9,
            blocks,
            config.kv_block_size,
            row_blocks,
        )
        return KVBudget(blocks, config.kv_block_size, row_blocks=row_blocks)

    @property
    def info(self):
        return self.model.info

    @property
    def prefix_cache(self):
        return self.runner.prefix_cache

    @property
    def flush_events(self) -> Callable[[], None]:
        return self.runner.flush_events

    @flush_events.setter
    def flush_events(self, fn: Callable[[], None]) -> None:
        """Hands the events emitted so far over now (the engine's; called mid-step too)."""
        self.runner.flush_events = fn

    # ---- any thread ------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.sched.add(req)

    @property
    def num_running(self) -> int:
        return self.sched.num_running

    @property
    def num_waiting(self) -> int:
        return self.sched.num_waiting

    # ---- worker thread -------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_requests() or self.runner.inflight is not None

    def step(self) -> None:
        trace = self._trace
        if trace is not None:
            trace.start()
            self.runner.take_host_ms()  # what earlier steps spent is not this step's
        started = time.perf_counter()
        self.stats.steps += 1
        if self._rehearsal_ended():
            self._end_rehearsal()
        if self._step_memory is not None:
            self._step_memory.apply()
        self.sched.take_inbox()
        self._drop_cancelled()
        self.runner.resume_preempted()
        self._admit()
        if self.runner.inflight is not None and self.sched.prefilling:
            # Prefill holds this thread for a while (vision, embeddings, forward): hand out the
            # previous decode step's tokens first, not after it (the first tokens of the group
            # admitted one step earlier would otherwise wait for this step's group).
            self.runner.read_inflight()
            self.runner.flush_events()
        if trace is not None:
            trace.mark("admit")
        embedded, plan, prefill_spans = self._prefill()
        prefilled_at = time.perf_counter()
        self.runner.stage(self.sched.to_stage())
        if trace is not None:
            trace.mark("stage")
        self.runner.decode()
        self._idle_since = None if self.has_work() else time.monotonic()
        if trace is not None:
            trace.mark("decode")
            trace.end(
                embedded=len(embedded),
                images=sum(seq.req.prepared.num_images for seq in embedded),
                prefill_rows=len(prefill_spans),
                prefill_tokens=sum(n for _, n in prefill_spans),
                pieces=len(plan.pieces),
                together=len(plan.group),
                decode_rows=len(self.sched.running),
                **{f"{k}_host_ms": round(v, 3) for k, v in self.runner.take_host_ms().items()},
            )

        def what() -> str:
            return (
                f"a step that embedded {len(embedded)} requests "
                f"({sum(seq.req.prepared.num_images for seq in embedded)} images), prefilled "
                f"{len(plan.singles)} alone, {len(plan.group)} together and pieces of {len(plan.pieces)}, "
                f"and decoded {len(self.sched.running)} rows"
            )

        self._note_peak(what)
        if self._built_kernels_ready():  # a load of a second or less, once
            self._take_built_kernels()
        elif self.model.attention_plan_due():  # tens of ms, once per recurring shape
            self._build_attention_plan(hot=True)
        took = time.perf_counter() - started
        if took >= SLOW_STEP_S:  # a step this long stalls every stream: say what it ran
            log.warning(
                "slow step: %.2f s (embedding and prefill %.2f s; prefill spans [from, tokens]: %s; "
                "pixel inputs embedded: %s), %s",
                took,
                prefilled_at - started,
                prefill_spans,
                [_pixel_shapes(seq.req.prepared) for seq in embedded if seq.req.prepared.has_pixels],
                what(),
            )
        self._read_memory()

    def _note_peak(self, where: Callable[[], str]) -> None:
        """Log each new high of MLX's memory (by 256 MB or more) with what ran since the last check
        (`where()`, said only then): where the device memory beyond weights and KV goes, read off the log."""
        peak = mx.get_peak_memory()
        if peak >= self._peak_noted + (256 << 20):
            self._peak_noted = peak
            log.info(
                "MLX memory peaked at %.2f GB (active now %.2f GB, cached %.2f GB) in %s",
                peak / 1e9,
                mx.get_active_memory() / 1e9,
                mx.get_cache_memory() / 1e9,
                where(),
            )

    def _read_memory(self) -> None:
        """MLX's memory figures for the gauges, at most once a second (read here, on the worker),
        and at the step whose batch emptied (no step may follow for a while to read them)."""
        now = time.monotonic()
        emptied = self.runner.batch is None and self._memory.get("row_states", 0) > 0
        if now - self._memory_read >= 1.0 or emptied:
            self._memory_read = now
            self._memory = {
                "active": mx.get_active_memory(),
                "cache": mx.get_cache_memory(),
                "peak": mx.get_peak_memory(),
                "kv_pool": self.runner.batches.pool_bytes(),
                "row_states": self.runner.batch.state_bytes() if self.runner.batch is not None else 0,
                "prefix_states": sum(cache.state_bytes for cache in self.runner.prefix_caches()),
            }

    def _drop_cancelled(self) -> None:
        gone = self.sched.take_cancelled()
        for req in gone.waiting:
            req.emit(TokenEvent(finish_reason=FinishReason.ABORT))
        for seq in gone.prefilling + gone.preempted + gone.running:
            self.runner.finish(seq, FinishReason.ABORT)
        self.runner.remove_rows(gone.running)

    def _admit(self) -> None:
        admitted, failed = self.sched.admit(self.runner.new_row)
        for req, exc in failed:
            if isinstance(exc, PromptTooLong):  # the request's own fault: no traceback
                log.info("request %s refused at admission: %s", req.request_id, exc)
                req.emit(TokenEvent(finish_reason=FinishReason.ERROR, error=str(exc), error_code=TOO_LONG))
                continue
            log.error("request %s failed at admission: %r", req.request_id, exc, exc_info=exc)
            req.emit(TokenEvent(finish_reason=FinishReason.ERROR, error=f"admission failed: {type(exc).__name__}"))
        if self.hooks:
            for seq in admitted:
                self.hooks.on_admit(seq.req)

    def _prefill(self) -> tuple[list[Sequence], PrefillPlan, list[tuple[int, int]]]:
        """This step's prefill; returns the requests it embedded, its plan and the prompt spans it
        prefilled as (first position, most tokens), for the step's log lines."""
        # The new requests this step's budget reaches are embedded in one call, so their images
        # go through the vision tower together.
        todo, _ = self.sched.unembedded_in_budget()
        if len(todo) >= 2:
            self.runner.embed_together(todo)
        plan = self.sched.plan_prefill(self.runner.embed)
        for seq, exc in plan.failed:
            self.runner.fail_prefill(seq, exc)
        if self._trace is not None:
            self._trace.mark("embed")  # the vision tower and embeddings (and prefix-cache lookups)
        pieces = [seq.next_piece(budget) for seq, budget in plan.singles + plan.pieces]
        pieces += [seq.next_piece(seq.prefill_end) for seq in plan.group]
        spans = [(start, end - start) for start, end in pieces]
        for seq, budget in plan.singles:
            self.runner.prefill_alone(seq, budget)
        if plan.pieces:
            self.runner.prefill_pieces(plan.pieces)
        if plan.group:
            try:
                self.runner.prefill_group(plan.group, self.sched.prefill_bucket)
            except Exception as exc:  # the batched forward failed: those requests end, others go on
                for seq in plan.group:
                    # not one its join set aside, nor one that ended, nor one that stopped at its
                    # checkpoint (it goes on from a cache of its own)
                    if seq in self.sched.prefilling and not 0 < seq.prefilled < seq.prefill_end:
                        self.runner.fail_prefill(seq, exc)
        if self._trace is not None:
            self._trace.mark("prefill")
        return todo, plan, spans

    def release_idle_memory(self) -> None:
        """Hand MLX's cached buffers back once idle for `idle_release_s` (other processes share the device).

        Not as soon as work runs out: freeing the pool holds the GIL for tens of ms (an event
        loop stall), and the next request allocates every buffer again, which roughly doubles
        its time to first token.
        """
        if self._idle_since is not None and time.monotonic() - self._idle_since >= self.idle_release_s:
            self._idle_since = None
            self.runner.release_memory()
            mx.clear_cache()
            self._memory_read = 0.0  # the gauges show what went back: no step may read them for a while
            self._read_memory()

    def fail_all(self, message: str) -> None:
        """Wake every waiter with an error the client may retry elsewhere (worker death or shutdown)."""
        waiting, admitted = self.sched.clear()
        for req in waiting:
            req.emit(TokenEvent(finish_reason=FinishReason.UNAVAILABLE, error=message))
        for seq in admitted:
            self.runner.finish(seq, FinishReason.UNAVAILABLE, error=message)
        self.runner.drop_all()

    def forget_prefixes(self) -> None:
        for cache in (self.prefix_cache, self.runner.mm_prefix_cache, self.model.feature_cache):
            if cache is not None:
                cache.clear()

    def cache_gauges(self) -> CacheGauges:
        pc, budget, features = self.prefix_cache, self.sched.kv_budget, self.model.feature_cache
        return CacheGauges(
            prefix_usage=pc.size_tokens / max(1, pc.max_tokens) if pc is not None else None,
            mm_prefix_usage=mm.size_tokens / max(1, mm.max_tokens) if (mm := self.runner.mm_prefix_cache) else None,
            kv_tokens=sum(s.cache_len for s in list(self.sched.running)),
            kv_blocks_used=budget.used,
            kv_blocks_total=budget.total,
            kv_blocks_cached=sum(c.blocks_held() for c in self.runner.prefix_caches()),
            preemptions=budget.preemptions,
            memory=dict(self._memory),
            feature_queries=features.queries if features is not None else 0,
            feature_hits=features.hits if features is not None else 0,
            warmup_pending=len(self._shapes_to_warm)
            + len(self._lengths_to_warm)
            + self._idle_warmups_due()
            + self.model.kernels_pending()
            + (self.kernel_builds.pending() if self.kernel_builds is not None else 0)
            + self._grammars_due()
            + self._kernels_filing(),
        )

    def _kernels_filing(self) -> int:
        """Kernel builds side processes are still filing into the kernel cache (MLX's indexing
        modules and fused kernels, vlmserve's kernels): 1 while any are, so `warmup_pending`
        reaching 0 also means the cache holds what this start built."""
        filer = kernel_disk_cache.filer()
        indexing = self.indexing_builds is not None and self.indexing_builds.running()
        return int(indexing or self.rehearsal is not None or (filer is not None and filer.busy()))

    # ---- warm-up (worker thread, before any request) -----------------------------------
    def warm_up(self, prompts: list[PreparedRequest]) -> None:
        """Build the shapes real traffic will use: on CUDA a shape seen for the first time costs a
        kernel compile (tens of ms for a prompt length, more for an image size).

        `prompts` were prepared by the serving side through a client's path (a text prompt
        first, then one per warm-up image size). Each is generated alone, then one prompt per
        prefill-length bucket up to a chunk, and one per power-of-two row count of the piece that
        follows a full chunk; then the vision tower at every image count one
        step can batch, and the compiled decode step at every slot bucket up to max_num_seqs and
        every KV capacity that prompts up to two prefill chunks use (longer ones trace once,
        when they come)."""
        self.warm_up_due = False
        self.note_decode_builds()
        self._await_side_builds()
        jobs = [(f"warmup-{i}", p) for i, p in enumerate(prompts)]
        bucket = self.sched.prefill_bucket
        if bucket > 0 and prompts:
            filler = int(prompts[0].prompt_ids[-1])
            longest = min(self.sched.prefill_chunk, self.info.context_length - 2)  # the prompt, one more, a token
            for length in range(bucket, longest + 1, bucket):
                jobs.append((f"warmup-len-{length}", PreparedRequest(prompt_ids=np.full(length + 1, filler, np.int32))))
            # A prompt longer than a chunk, or one continuing a cached prefix, is prefilled in pieces
            # of any row count, and kernels are picked by row class (MLX's quantized matmul on CUDA
            # has one per power of two from 16 to 64 rows; kernel_prebuild builds them, and they
            # load here once built): one prompt per class for the piece after a full chunk.
            chunk = self.sched.prefill_chunk
            rows = 2
            while rows <= bucket and chunk + rows + 2 <= self.info.context_length:
                jobs.append(
                    (f"warmup-tail-{rows}", PreparedRequest(prompt_ids=np.full(chunk + rows + 1, filler, np.int32)))
                )
                rows *= 2
        t0 = time.perf_counter()
        # Each job alone, yet prefilled a chunk a step as under load: the tail jobs are there for
        # the piece that follows a full chunk.
        lone_takes_budget, self.sched.lone_takes_budget = self.sched.lone_takes_budget, False
        try:
            for i, (name, prepared) in enumerate(jobs, 1):  # one at a time: each must be its own shape
                # The length buckets share a prefix; a prefix-cache hit would skip the very prefill
                # shape this job is here to compile.
                self.forget_prefixes()
                t1 = time.perf_counter()
                self._generate_alone(name, prepared)
                log.info("warm-up %d/%d: %s in %.2f s", i, len(jobs), name, time.perf_counter() - t1)
        finally:
            self.sched.lone_takes_budget = lone_takes_budget
        self.forget_prefixes()
        log.info("warm-up generations: %d in %.1f s", len(jobs), time.perf_counter() - t0)
        t0, runs = time.perf_counter(), 0
        if self._step_memory is not None:
            self._step_memory.apply()
        for prepared in prompts:
            if prepared.has_pixels:
                runs += self.model.warm_vision(prepared, self._vision_batch_limit(prepared))
        if runs:
            log.info("warmed %d vision-tower shapes in %.1f s", runs, time.perf_counter() - t0)
        self._note_peak(lambda: "warm-up")
        cached = kernel_disk_cache.filer()
        if cached is not None and (cached.found or cached.queued):
            log.info(
                "vlmserve's CUDA kernels: %d found in the kernel cache, %d not (queued for side processes to file)",
                cached.found,
                cached.queued,
            )
        self._warm_decode(min(self.sched.max_num_seqs, WARM_SLOTS), later_rows=self.sched.max_num_seqs)
        self._warmed = True
        # On CUDA a padded length's first run costs tens of ms (the matmuls' setup per shape);
        # elsewhere nothing measured does, and the forwards would only keep the worker busy.
        if on_cuda() and self.model.prefills_pieces and prompts:
            self._filler_token = int(prompts[0].prompt_ids[-1])
            self._lengths_to_warm = self.runner.piece_lengths_to_warm()
            if self._lengths_to_warm:
                log.info(
                    "%d prompt piece lengths past a chunk (%d to %d) to run once while idle",
                    len(self._lengths_to_warm),
                    self._lengths_to_warm[0],
                    self._lengths_to_warm[-1],
                )

    def note_decode_builds(self) -> None:
        """Queue the decode step's kernel builds for side processes and start filing what is
        queued (the model's builds too): they compile beside warm-up, which then reads those
        that landed in time, and the filing is over sooner (the compile rehearsal's hand-over
        waits for it). Once; a no-op where nothing is filed."""
        filer = kernel_disk_cache.filer()
        if self._decode_builds_noted or filer is None:
            return
        self._decode_builds_noted = True
        if self._queue_decode_builds(min(self.sched.max_num_seqs, WARM_SLOTS)):
            # The traces went through kernels the decode checks may still replace: drop them
            # (_warm_decode traces again).
            self.runner.batches.retrace()
        filer.hurry()

    def _await_side_builds(self) -> None:
        """On a start that builds vlmserve's kernels (an empty kernel cache), wait for those the
        first warm-up generation uses: side processes build them side by side, where that
        generation's first launches would compile them on this thread one after another (~1 s
        each on an H100 host). Bounded: past SIDE_BUILD_WAIT_S, this thread compiles what is left."""
        filer = kernel_disk_cache.filer()
        if filer is None:
            return
        t0 = time.perf_counter()
        awaited, landed = filer.await_soon(SIDE_BUILD_WAIT_S)
        if awaited:
            took = time.perf_counter() - t0
            log.info(
                "waited %.1f s for %d of vlmserve's CUDA kernels built side by side (%d landed)", took, awaited, landed
            )

    def _warm_decode(self, rows: int, later_rows: int = 0) -> None:
        """Build and check the decode step's kernels, then trace the compiled step at every row
        bucket up to `rows` and every KV width prompts of two prefill chunks take: before ready,
        as on a first start each costs seconds of compiling that every stream would wait for.
        vlmserve's kernels among them compile side by side in build processes (queued at load
        for the checks, by a trace that is not run for the steps), and are then read from the
        kernel cache; MLX's own fused kernels compile here. Bounded whatever --max-num-seqs is:
        the row buckets past `rows` up to `later_rows`, and where attention gathers each row's KV
        (the step's shape then depends on the longest row) the widths of rows up to
        IDLE_WIDTH_TOKENS, are left for idle time; a shape idle time has not traced yet (a big
        batch right after start) or never traces (a grown pool, a longer row where attention
        gathers) is traced when it comes, on its second step."""
        t0 = time.perf_counter()
        while self._built_kernels_ready():  # traced with them, not again
            self._take_built_kernels()
        while self.model.kernels_pending():
            self._build_kernel()
        shapes = self._queue_decode_builds(rows)
        self._warm_shapes = list(shapes)
        if not shapes:
            return
        filer = kernel_disk_cache.filer()
        if filer is not None:
            filer.flush()
        self._shapes_to_warm = list(shapes)
        traced = 0
        while self._shapes_to_warm:
            traced += self._warm_next_shape()
        log.info("decode step: kernels checked and %d shapes compiled in %.1f s", traced, time.perf_counter() - t0)
        later = [s for s in self.runner.batches.shapes_to_warm(later_rows, self._idle_capacity()) if s not in shapes]
        if later:
            self._warm_shapes += later
            self._shapes_to_warm = later
            warm_widths = {width for _, width in shapes}
            wider = any(width not in warm_widths for _, width in later)  # where attention gathers
            log.info(
                "%d decode shapes (up to %d rows%s) to compile while idle",
                len(later),
                later_rows,
                f", rows of up to {self._idle_capacity()} positions" if wider else "",
            )
        self._warm_wider_rows(later_rows)

    def _warm_wider_rows(self, rows: int) -> None:
        """Queue for idle time the decode shapes, up to `rows` rows, of every other KV dtype warm-up
        met: rows whose prompts embed wider than the model (float32 image embeddings in a bfloat16
        model) decode on a pool of their own, whose shapes would otherwise trace on their second
        step while every stream waits."""
        batches = self.runner.batches
        for dtype in batches.other_kv_dtypes():
            wider = [(n, width, dtype) for n, width in batches.shapes_to_warm(rows, self._warm_capacity(), dtype)]
            self._warm_shapes += wider
            self._shapes_to_warm += wider
            if wider:
                log.info("%d decode shapes of %s KV rows to compile while idle", len(wider), dtype)

    def warm_wider_shapes(self, rows: int = WARM_SLOTS) -> int:
        """Trace now the decode shapes of up to `rows` rows queued for other KV dtypes
        (`_warm_wider_rows`; the compile rehearsal, where MLX files their fused kernels, as it
        does the model dtype's warm rows); returns how many traced."""
        now = [shape for shape in self._shapes_to_warm if len(shape) == 3 and shape[0] <= rows]
        self._shapes_to_warm = now + [shape for shape in self._shapes_to_warm if shape not in now]
        traced = 0
        for _ in now:
            if not self._shapes_to_warm:  # a failed trace drops the queue
                break
            traced += self._warm_next_shape()
        return traced

    def _warm_capacity(self) -> int:
        """The longest row the warm decode shapes hold: two prefill chunks."""
        return min(self.info.context_length, 2 * self.sched.prefill_chunk)

    def _idle_capacity(self) -> int:
        """The longest row the decode shapes left for idle time hold (where the step's shape
        depends on it: DecodeSteps.table_width); longer rows trace theirs on their second step."""
        return min(self.info.context_length, max(IDLE_WIDTH_TOKENS, self._warm_capacity()))

    def _queue_decode_builds(self, rows: int) -> list[tuple[int, int]]:
        """Trace the compiled decode step, without running it, at each shape warm-up compiles for
        up to `rows` rows: the builds of vlmserve's kernels it launches are queued for side
        processes (kernel_disk_cache). Returns those shapes."""
        shapes = self.runner.batches.shapes_to_warm(rows, self._warm_capacity())
        if shapes and kernel_disk_cache.filer() is not None:
            try:
                for n, width in shapes:
                    self.runner.batches.note_builds(n, width)
            except Exception:  # noqa: BLE001 - only a head start: the traces build what is missing
                log.warning("queueing the decode step's kernel builds failed", exc_info=True)
        return shapes

    def has_idle_work(self) -> bool:
        """Warm-up left for idle time: kernels built by side processes to take, kernels not built
        yet, decode shapes not compiled yet, attention plans for shapes traffic brought, prompt
        piece lengths not run yet, the structured-output tokenizer."""
        if self.warm_up_due:
            return False
        if self._built_kernels_ready() or self._rehearsal_ended():
            return True
        if self._shapes_to_warm or self._lengths_to_warm or self._idle_warmups_due():
            return True
        if self.model.kernels_pending() > 0 or self.model.attention_plans_pending() > 0:
            return True
        return self._grammars_due()

    def _idle_warmups_due(self) -> int:
        """The model's shapes to run once while idle (ModelAdapter.idle_warmups_pending), once
        warm-up is over."""
        return self.model.idle_warmups_pending() if self._warmed else 0

    def _warm_next_idle(self) -> None:
        t0 = time.perf_counter()
        try:
            self.model.warm_next_idle()
        except Exception:  # noqa: BLE001 - only a head start: traffic meets that shape first instead
            log.warning("an idle warm-up run failed", exc_info=True)
            return
        if not self.model.idle_warmups_pending():
            log.info("ran the model's idle warm-up shapes (the last in %.3f s)", time.perf_counter() - t0)

    def _grammars_due(self) -> bool:
        """The structured-output tokenizer is built while idle once warm-up is over (before it,
        the worker is the warm-up's)."""
        return self._warmed and self.runner.grammars_pending()

    def idle_work(self) -> None:
        """One piece of the warm-up left for idle time: switch to compiled kernels once the side
        process compiling them is done, else take the kernels side processes built, else build one
        kernel, else compile one decode shape (a second or so each on CUDA), else build one
        attention plan (~70 ms), else run one prompt piece length, else build the structured-output
        tokenizer; a request that arrives meanwhile waits for it."""
        if self._rehearsal_ended():
            self._end_rehearsal()
        elif self._built_kernels_ready():
            self._take_built_kernels()
        elif self.model.kernels_pending():
            self._build_kernel()
        elif self._shapes_to_warm:
            self._warm_next_shape()
        elif self.model.attention_plans_pending():
            self._build_attention_plan()
        elif self._lengths_to_warm:
            self._warm_piece_length()
        elif self._idle_warmups_due():
            self._warm_next_idle()
        else:
            self.runner.prepare_grammars()
        if not self.has_work():  # what it made (a pool it traced on) is handed back after the next idle spell
            self._idle_since = time.monotonic()

    def _warm_next_shape(self) -> bool:
        """Trace the compiled decode step at the next shape to warm; returns whether it traced."""
        rows, width, *dtype = self._shapes_to_warm[0]  # taken off once compiled: warmup_pending counts it meanwhile
        t0 = time.perf_counter()
        try:
            traced = self.runner.batches.warm_shape(rows, width, *dtype)
        except Exception:  # e.g. out of memory: those shapes are traced when traffic brings them
            log.warning("compiling decode shapes failed; they compile when first used", exc_info=True)
            self._shapes_to_warm.clear()
            return False
        self._shapes_to_warm.pop(0)
        of_kv = f" of {dtype[0]} KV" if dtype else ""
        if traced:
            took, now = time.perf_counter() - t0, time.monotonic()
            shown = not self._shapes_to_warm or took >= 0.5 or now - self._shape_logged >= SHAPE_LOG_S
            if shown:
                self._shape_logged = now
            log.log(
                logging.INFO if shown else logging.DEBUG,
                "compiled the decode step for %d rows x %d blocks%s in %.2f s (%d to go)",
                rows,
                width,
                of_kv,
                took,
                len(self._shapes_to_warm),
            )
        elif not self._shapes_to_warm:  # the queue's end is logged whoever compiled its last shape
            log.info("the decode step for %d rows x %d blocks%s was compiled already (0 to go)", rows, width, of_kv)
        self._note_peak(lambda: f"compiling the decode step for {rows} rows")
        return traced

    def _build_attention_plan(self, hot: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            self.model.build_next_attention_plan(hot)
        except Exception:  # noqa: BLE001 - that shape keeps the plan-free kernel
            log.warning("building an attention plan failed; that shape keeps its plan-free kernel", exc_info=True)
            return
        left = self.model.attention_plans_pending()
        log.debug("built an attention plan in %.3f s (%d to go)", time.perf_counter() - t0, left)

    def _warm_piece_length(self) -> None:
        """Run the shortest piece length not run yet. Longer ones take longer, and a request that
        arrives meanwhile waits: past IDLE_PIECE_MAX_S the rest are left to traffic (their compute
        then outweighs the setup a first run adds)."""
        length = self._lengths_to_warm[0]  # taken off once run: warmup_pending counts it meanwhile
        t0 = time.perf_counter()
        try:
            self.runner.warm_piece_length(length, self._filler_token)
        except Exception:  # e.g. out of memory: those lengths pay their first run when traffic brings them
            log.warning("running prompt piece lengths while idle failed", exc_info=True)
            self._lengths_to_warm.clear()
            return
        self._lengths_to_warm.pop(0)
        took = time.perf_counter() - t0
        if took > IDLE_PIECE_MAX_S and self._lengths_to_warm:
            log.info("a prompt piece of %d positions took %.2f s; longer ones are not run while idle", length, took)
            self._lengths_to_warm.clear()
        elif not self._lengths_to_warm:
            log.info("ran the prompt piece lengths while idle (the last, %d positions, in %.2f s)", length, took)
        self._note_peak(lambda: f"running a prompt piece of {length} positions")

    def _build_kernel(self) -> None:
        """Build and check one of the model's pending kernels; after the last, decode steps traced
        meanwhile trace again, now with them. Before the first, the builds queued for side
        processes at load are waited for: the checks then read them from the kernel cache."""
        t0 = time.perf_counter()
        if not self._kernels_filed:
            self._kernels_filed = True
            filer = kernel_disk_cache.filer()
            if filer is not None:
                filer.flush()
        try:
            self.model.build_next_kernel()
        except Exception:  # the op it would replace keeps serving
            log.warning("building a kernel failed; the op it replaces serves instead", exc_info=True)
        self._kernel_seconds += time.perf_counter() - t0
        if not self.model.kernels_pending():
            self.runner.batches.retrace()
            log.info("decode kernels built and checked in %.1f s", self._kernel_seconds)

    def _built_kernels_ready(self) -> bool:
        """Whether a setting's background kernel builds have all ended (`_take_built_kernels`)."""
        return self.kernel_builds is not None and self.kernel_builds.ready()

    def _take_built_kernels(self) -> None:
        """Load one setting's kernels the side processes built: the layers that ran dequantized
        meanwhile take them from the next call on. A compiled decode step keeps what it was traced
        with, so the step traces again (the warm shapes while idle, others on their second step):
        tens of ms a shape, as every kernel is loaded by then."""
        builds = self.kernel_builds
        try:
            taken = builds.take_one()
        except Exception:  # noqa: BLE001 - that setting stays dequantized, as if its build had failed
            log.warning("loading built quantized matmul kernels failed; those layers stay dequantized", exc_info=True)
            taken = None
        if taken is not None:
            setting, dtype = taken
            many_row_dequantized.release(setting, getattr(mx, dtype))
            self._kernels_replaced()
        if not builds.pending():
            self.kernel_builds = None

    def _kernels_replaced(self) -> None:
        """Other kernels serve from now on (compiled ones, or quantized matmuls for dequantized
        weights). A compiled decode step keeps what it was traced with, so the step traces again
        (the warm shapes while idle, others at their next step). And they may round differently:
        KV and features the old ones computed, cached or held by rows in flight, never go to
        later requests, whose outputs would then differ from a fresh computation's."""
        self.runner.batches.retrace()
        self._shapes_to_warm = list(self._warm_shapes)
        self.forget_prefixes()
        for seq in (*self.sched.prefilling, *self.sched.running, *self.sched.preempted):
            seq.kv_reusable = False

    def set_aside_for_rehearsal(self, weights: int, working: int) -> None:
        """Take what the compile rehearsal's copy of the model holds (its weights, a KV pool the
        size of this engine's first one, its rows' state and `working` bytes) off the KV budget,
        at most half of it, until the rehearsal ends: the two processes then stay within the
        device's memory."""
        budget = self.sched.kv_budget
        if budget is None or not pages_kv(self.model):
            return
        block = kv_block_bytes(self.model, budget.block_size)
        pool = budget.blocks_for(self.sched.max_num_seqs * 2 * self.sched.prefill_chunk) * block
        pool += state_reserve_bytes(self.model, self.sched.max_num_seqs)
        # Never below one row at the context length the server announces.
        room = budget.total - budget.blocks_for(self.info.context_length) - 1
        blocks = max(0, min(budget.total // 2, room, -(-(weights + pool + working) // block)))
        budget.resize(budget.total - blocks)
        budget.lent += blocks
        log.info("KV budget: %.2f GB set aside while the compile rehearsal runs", blocks * block / 1e9)

    def _rehearsal_ended(self) -> bool:
        return self.rehearsal is not None and self.rehearsal.done()

    def _end_rehearsal(self) -> None:
        """The side process compiling MLX's fused kernels ended (compile_rehearsal): with what it
        compiled filed, compile from the next graph on, which loads those kernels."""
        rehearsal, self.rehearsal = self.rehearsal, None
        ok = rehearsal.finish()
        budget = self.sched.kv_budget
        if budget is not None and budget.lent:
            budget.resize(budget.total + budget.lent)
            budget.lent = 0
        if rehearsal.interrupted:  # a shutdown's signal reached it first
            log.info("the side process compiling MLX's fused kernels was stopped; the next start compiles them again")
            return
        if not ok:
            log.warning(
                "compiling MLX's fused kernels in a side process failed: this run stays uncompiled "
                "(0.5-0.7x the compiled decode throughput on an H100); the next start compiles them "
                "during its warm-up"
            )
            return
        mx.enable_compile()
        self._kernels_replaced()
        log.info(
            "MLX's fused kernels compiled beside the engine in %.1f s and filed: compiling from now on",
            time.monotonic() - rehearsal.started,
        )

    def _vision_batch_limit(self, prepared: PreparedRequest) -> int:
        """The most images of this request's size one step embeds together: requests are taken
        until the prefill budget is spent, each counted at most a chunk."""
        image_token = self.info.image_token_id
        tokens = int((prepared.prompt_ids == image_token).sum()) if image_token is not None else 0
        per_image = self.sched.step_tokens(tokens // max(1, prepared.num_images))
        return min(self.sched.max_num_seqs, self.sched.prefill_budget // per_image + 1)

    def _generate_alone(self, name: str, prepared: PreparedRequest) -> None:
        events: list[TokenEvent] = []
        self.add(EngineRequest(name, prepared, _WARMUP_SAMPLING, events.append))
        while self.has_work():
            self.step()
        final = events[-1] if events else None
        if final is None or final.finish_reason is None or final.finish_reason.failed:
            raise RuntimeError(f"warm-up generation failed: {final.error if final else 'no result'}")
