"""The asyncio-facing engine: owns the worker thread, the model and the scheduler."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from typing import AsyncIterator

from ..config import ServerConfig
from ..protocol import EngineError, FinishReason, PreparedRequest, SamplingParams, TokenEvent
from ..protocol import ModelInfo
from .model import VLM, resolve_model_path
from .scheduler import EngineRequest, MLLMScheduler
from .thread_guard import GUARD
from .tokenizer import TextCodec
from .worker import MLXWorkerThread

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

    async def generate(self, request_id: str, prepared: PreparedRequest,
                       sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
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
        finished = False
        held: TokenEvent | None = None
        try:
            while True:
                event = held if held is not None else await queue.get()
                held = None
                # A reader behind the steps takes what has queued up as one event (vLLM's output
                # collector does the same): one chunk and one socket write instead of several.
                # An error or abort stays an event of its own, after the text before it.
                while event.finish_reason is None and not queue.empty():
                    after = queue.get_nowait()
                    if after.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        held = after
                        break
                    event = _joined(event, after)
                if event.finish_reason is not None:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                req.cancelled = True
                self.worker.wake()

    def _flush(self) -> None:
        """Hand a step's events to each event loop with one thread-safe call, not one per token."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is waiting any more
                pass

    async def run_on_worker(self, fn, *args, **kwargs):
        return await asyncio.wrap_future(self.worker.submit(fn, *args, **kwargs))

    async def stop(self) -> None:
        if self.scheduler is not None and self.worker.is_alive():
            try:
                await self.run_on_worker(self.scheduler.fail_all, "the server is shutting down")
            except Exception:  # noqa: BLE001 - the worker may already be gone
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        if self.config.thread_guard and self.worker.ident is not None:
            GUARD.release(self.worker.ident)


def _joined(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """Two consecutive events of one request as one; `first` is not its last."""
    return replace(then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                   logprobs=first.logprobs + then.logprobs)


def _deliver(items) -> None:
    for queue, event in items:
        queue.put_nowait(event)


__all__ = ["Engine", "FinishReason"]
