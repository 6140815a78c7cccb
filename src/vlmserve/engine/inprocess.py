"""The asyncio-facing engine: owns the worker thread, the model and the scheduler."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import mlx.core as mx

from vlmserve.config import ServerConfig
from vlmserve.engine.event_stream import deliver, read_events
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.scheduler import EngineRequest, MLLMScheduler
from vlmserve.engine.thread_guard import GUARD
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.models.generic import VLM, resolve_model_path
from vlmserve.protocol import EngineError, FinishReason, ModelInfo, PreparedRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: ServerConfig, hooks=None):
        self.config = config
        self.hooks = hooks
        self.worker = MLXWorkerThread()
        self.worker.after_work = self._flush
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # worker thread only
        self.info: ModelInfo | None = None
        self.model_path: Path | None = None
        self.scheduler: MLLMScheduler | None = None
        self.tokenizer = None

    async def start(self) -> None:
        """Resolve and load the model on the worker; raises with the reason if that fails."""
        loop = asyncio.get_running_loop()
        self.worker.start()
        if self.config.thread_guard:
            GUARD.install(self.worker.ident)
        self.model_path = await loop.run_in_executor(None, resolve_model_path, self.config.model)
        self.tokenizer = await loop.run_in_executor(None, TextCodec, self.model_path)
        await asyncio.wrap_future(self.worker.submit(self._load_on_worker))

    def _load_on_worker(self) -> None:
        mx.set_cache_limit(int(self.config.mlx_cache_limit_gb * (1 << 30)))
        vlm = VLM(self.model_path, self.tokenizer.eos_token_ids)
        if self.config.thread_guard:
            GUARD.watch_model(vlm.model)
        if self.config.max_model_len:
            vlm.info.context_length = min(vlm.info.context_length, self.config.max_model_len)
        self.info = vlm.info
        self.scheduler = MLLMScheduler(
            vlm,
            self.tokenizer,
            max_num_seqs=self.config.max_num_seqs,
            prefill_chunk=self.config.prefill_chunk,
            prefill_budget=self.config.prefill_token_budget,
            prefill_bucket=self.config.prefill_bucket,
            prefix_cache_tokens=self.config.prefix_cache_tokens,
            compile_decode=self.config.compile_decode == "on"
            or (self.config.compile_decode == "auto" and mx.default_device() == mx.gpu),
            idle_release_s=self.config.release_cache_after_idle_s,
            hooks=self.hooks,
        )
        self.scheduler.flush_events = self._flush
        self.worker.scheduler = self.scheduler

    @property
    def healthy(self) -> bool:
        return self.worker.healthy

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running if self.scheduler else 0

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting if self.scheduler else 0

    async def generate(
        self, request_id: str, prepared: PreparedRequest, sampling: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Stream one request's events; leaving the iterator early cancels the request."""
        if self.scheduler is None or not self.worker.healthy:
            raise EngineError("the inference worker is not running", code="worker_unavailable", status=503)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:  # worker thread: batched, see _flush
            self._outbox.setdefault(loop, []).append((queue, event))

        req = EngineRequest(request_id, prepared, sampling, emit)
        self.scheduler.add(req)
        self.worker.wake()
        if not self.worker.healthy:  # it died (or stopped) after the check above: nobody would answer
            try:
                self.scheduler.inbox.remove(req)
            except ValueError:
                pass  # the exiting worker already took it and emits its error
            else:
                raise EngineError("the inference worker is not running", code="worker_unavailable", status=503)

        def leave() -> None:  # the reader left before the end: cancel
            req.cancelled = True
            self.worker.wake()

        events = read_events(queue, leave)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # now, not when collected: a reader that left cancels at once

    def _flush(self) -> None:
        """Hand a step's events to each event loop with one thread-safe call, not one per token."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is waiting any more
                pass

    async def run_on_worker(self, fn, *args, **kwargs):
        return await asyncio.wrap_future(self.worker.submit(fn, *args, **kwargs))

    # ---- what the server asks of any engine (engine_client.EngineProcessClient answers the same) ----
    async def forget_prefixes(self) -> None:
        await self.run_on_worker(self._forget_prefixes)

    def _forget_prefixes(self) -> None:  # worker thread: the cache holds MLX arrays
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.clear()

    async def warm_decode(self, max_rows: int, capacity: int) -> int:
        """Trace the compiled decode step's shapes; returns how many."""
        return await self.run_on_worker(self._warm_decode, max_rows, capacity)

    async def warm_vision(self, prepared: PreparedRequest) -> int:
        return await self.run_on_worker(self._warm_vision, prepared)

    async def fail_all(self, message: str) -> None:
        if self.scheduler is not None and self.healthy:
            await self.run_on_worker(self._fail_all, message)

    # worker thread (engine_process.py calls these by name too)
    def _warm_decode(self, max_rows: int, capacity: int) -> int:
        return self.scheduler.batches.warm(max_rows, capacity)

    def _warm_vision(self, prepared: PreparedRequest) -> int:
        return self.scheduler.warm_vision(prepared)

    def _fail_all(self, message: str) -> None:
        self.scheduler.fail_all(message)

    def problem(self, stall_timeout: float, loading: bool) -> str | None:
        """Why the engine cannot serve (None: it can)."""
        worker = self.worker
        if worker.error is not None or (worker.ident is not None and not worker.is_alive()):
            return "inference worker died"
        # A model load is one long job on the worker; the heartbeat only counts once serving.
        if not loading and worker.ident is not None and time.monotonic() - worker.heartbeat > stall_timeout:
            return "inference worker stalled"
        return None

    def cache_gauges(self) -> tuple[float | None, int]:
        """(prefix cache usage fraction or None without one, tokens in the running rows' KV)."""
        sched = self.scheduler
        if sched is None:
            return None, 0
        pc = sched.prefix_cache
        usage = pc.size_tokens / max(1, pc.max_tokens) if pc is not None else None
        return usage, sum(s.cache_len for s in list(sched.running))

    async def stop(self) -> None:
        if self.scheduler is not None and self.worker.is_alive():
            try:
                await self.run_on_worker(self.scheduler.fail_all, "the server is shutting down")
            except Exception:  # noqa: BLE001 - the worker may already be gone
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        if self.config.thread_guard and self.worker.ident is not None:
            GUARD.release(self.worker.ident)


__all__ = ["Engine", "FinishReason"]
