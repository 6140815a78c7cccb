"""The engine on a worker thread of this process: the EngineClient for one-process serving.

It owns the MLX worker thread and the EngineCore stepped on it; the event loop only hands
requests over and reads each request's events (engine/event_stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from vlmserve.config import ServerConfig
from vlmserve.cuda_graphs import choose_cuda_graphs
from vlmserve.engine import compile_rehearsal, kernel_prebuild, side_builds
from vlmserve.engine.core import EngineCore
from vlmserve.engine.event_stream import deliver, read_events
from vlmserve.engine.ops import cuda_kernels, kernel_disk_cache, many_row_dequantized
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.request import EngineRequest
from vlmserve.engine.side_builds import SideBuilds
from vlmserve.engine.thread_guard import GUARD
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.kernel_cache import use_persistent_kernel_cache
from vlmserve.models.paths import resolve_model_path
from vlmserve.models.registry import model_type_of
from vlmserve.protocol import (
    CacheGauges,
    EngineError,
    FinishReason,
    ModelInfo,
    PreparedRequest,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)

PREBUILD_TIMEOUT_S = 240.0  # the kernel build processes past this are stopped (see kernel_prebuild)


def _worker_unavailable() -> EngineError:
    return EngineError("the inference worker is not running", code="worker_unavailable", status=503)


class Engine:
    def __init__(self, config: ServerConfig, hooks=None, side: SideBuilds | None = None):
        """`side`: the kernel builds already started for this model (side_builds.start_early)."""
        self.config = config
        self.hooks = hooks
        self.worker = MLXWorkerThread()
        self.worker.after_work = self._flush
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # worker thread only
        self._waiting: dict[asyncio.Queue, Callable] = {}  # the loop's: requests being read, and how to cancel each
        self.info: ModelInfo | None = None
        self.model_path: Path | None = None
        self.model_type: str | None = None
        self.core: EngineCore | None = None
        self.tokenizer = None
        self._side = side
        self._prebuild: list = side.qmm if side else []  # kernel build processes still running (kernel_prebuild)
        self._indexing = side.indexing if side else None  # MLX's indexing kernels building beside the load
        self._rehearsal = None  # MLX's fused kernels compiling beside the engine (compile_rehearsal)

    async def start(self) -> None:
        """Resolve and load the model on the worker; raises with the reason if that fails."""
        loop = asyncio.get_running_loop()
        # `vlmserve serve` named the caches before MLX started CUDA; here (MLX imported) only MLX's
        # own PTX directory still takes effect, for an engine embedded some other way.
        use_persistent_kernel_cache()
        choose_cuda_graphs(self.config.cuda_graphs)  # takes effect unless this process already ran GPU work
        self.worker.start()
        if self.config.thread_guard:
            GUARD.install(self.worker.ident)
        if self._side is not None:
            self.model_path = self._side.model_path
        else:
            self.model_path = await loop.run_in_executor(None, resolve_model_path, self.config.model)
        # An unknown model fails here, named, before the tokenizer or weights load.
        self.model_type = await loop.run_in_executor(None, model_type_of, self.model_path)
        if self._side is None:
            side = side_builds.start(self.model_path)
            self._prebuild, self._indexing = side.qmm, side.indexing
        if cuda_kernels.on_cuda():
            if self._prebuild:
                # Until their builds land, layers many_row_dequantized serves run dequantized (from
                # the load's probes on); _load_on_worker lets go of what it does not serve.
                many_row_dequantized.hold({b.setting for b in self._prebuild if b.mode == "affine"})
            self._rehearsal = compile_rehearsal.start(
                self.model_path, self.model_type, self.config, many_row_dequantized.held()
            )
            if self._rehearsal is not None:
                log.info("compiling MLX's fused kernels in a side process; until it is done the engine runs uncompiled")
        self.tokenizer = await loop.run_in_executor(None, TextCodec, self.model_path)
        await self.run_on_worker(self._load_on_worker)

    def _load_on_worker(self) -> None:
        core = EngineCore.load(
            self.config, self.model_path, self.model_type, self.tokenizer, self.hooks, self._await_first_kernels
        )
        if self.config.thread_guard:
            GUARD.watch_model(core.model.model)
        self.info = core.info
        core.indexing_builds = self._indexing
        core.rehearsal = self._rehearsal
        if self._rehearsal is not None:
            core.set_aside_for_rehearsal(self._rehearsal.weights, compile_rehearsal.WORKING_BYTES)
        core.warm_up_due = self.config.warmup
        if core.warm_up_due:  # their builds start now, beside what is left of the start
            core.note_decode_builds()
        core.flush_events = self._flush
        self._build_in_background(core)
        self.core = core
        self.worker.core = core

    def _await_first_kernels(self) -> None:
        """Before the load's first forward: let the indexing builds under way land instead of
        compiling those modules a second time on this thread (indexing_prebuild.Prebuild.wait_for_first)."""
        if self._indexing is not None:
            waited = self._indexing.wait_for_first()
            if waited >= 0.1:
                log.info("waited %.1f s for the first of MLX's indexing kernels being built", waited)

    def _build_in_background(self, core: EngineCore) -> None:
        """Hand the kernel builds whose layers run dequantized meanwhile to the worker, which takes
        their kernels as they come (kernel_prebuild.Background); the rest are waited for before warm-up."""
        held = many_row_dequantized.held() if many_row_dequantized.installed(core.model.model) else frozenset()
        later = [b for b in self._prebuild if b.mode == "affine" and b.setting in held]
        self._prebuild = [b for b in self._prebuild if b not in later]
        for b in self._prebuild:
            many_row_dequantized.unhold(b.setting)
        if later:  # at a lower priority than the rest (side_builds): more time before they are given up
            core.kernel_builds = kernel_prebuild.Background(later, 2 * PREBUILD_TIMEOUT_S)
            log.info(
                "%d quantized matmul kernels build in the background; until they are built, quantized "
                "layers run dequantized over %d rows or more",
                len(later),
                many_row_dequantized.QMM_MIN_ROWS,
            )

    @property
    def healthy(self) -> bool:
        return self.worker.healthy

    @property
    def num_running(self) -> int:
        return self.core.num_running if self.core else 0

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting if self.core else 0

    async def generate(
        self,
        request_id: str,
        prepared: PreparedRequest,
        sampling: SamplingParams,
        registered: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream one request's events; leaving the iterator early cancels the request."""
        if self.core is None or not self.worker.healthy:
            raise _worker_unavailable()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:  # worker thread: batched, see _flush
            self._outbox.setdefault(loop, []).append((queue, event))

        req = EngineRequest(request_id, prepared, sampling, emit)
        self.core.add(req)
        self.worker.wake()
        if not self.worker.healthy:  # it died (or stopped) after the check above: nobody would answer
            try:
                self.core.sched.inbox.remove(req)
            except ValueError:
                pass  # the exiting worker already took it and emits its error
            else:
                raise _worker_unavailable()
        if registered is not None:  # the scheduler's inbox counts it now
            registered()

        def leave() -> None:  # the reader left before the end: cancel
            req.cancelled = True
            self.worker.wake()

        events = read_events(queue, leave)
        self._waiting[queue] = leave
        try:
            async for event in events:
                yield event
        finally:
            self._waiting.pop(queue, None)
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

    # ---- what the server asks of any engine (engine/client.py) ----------------------------
    async def warm_up(self, prompts: list[PreparedRequest]) -> None:
        await self.run_on_worker(self.warm_up_on_worker, prompts)

    def warm_up_on_worker(self, prompts: list[PreparedRequest]) -> CacheGauges:
        """Wait for the kernel builds started beside the load that nothing serves without (their
        kernels are then in the cache), then warm up: on the worker thread, in this process or
        an engine process. Returns the gauges as warm-up leaves them (what is left for idle
        time), which an engine process's client takes at once instead of at its next report."""
        builds, self._prebuild = self._prebuild, []
        kernel_prebuild.wait(builds, PREBUILD_TIMEOUT_S)
        if self.core.rehearsal is not None:
            filer = kernel_disk_cache.filer()  # what the load queued is handed over with the prompts
            self.core.rehearsal.hand_over(prompts, (lambda: not filer.busy()) if filer is not None else None)
        self.core.warm_up(prompts)
        return self.core.cache_gauges()

    def stop_kernel_builds(self) -> None:
        """Stop the kernel build processes still running and forget the settings they held
        dequantized. Those the worker takes are left to it while it runs (a worker that did not
        stop in time): they end on their own, filing nothing."""
        for build in self._prebuild:  # never waited for (no warm-up, or a failed load)
            build.kill()
        self._prebuild = []
        if self._indexing is not None:
            self._indexing.stop()
        if self._rehearsal is not None:
            self._rehearsal.stop()
            if not self.worker.is_alive():  # an engine stopped before its switch: this process compiles again
                compile_rehearsal.compile_again()
        builds = self.core.kernel_builds if self.core is not None else None
        if builds is not None and not self.worker.is_alive():
            builds.stop()
            self.core.kernel_builds = None
        many_row_dequantized.reset()

    def abandon(self, message: str) -> int:
        waiting, self._waiting = self._waiting, {}
        for queue, cancel in waiting.items():
            queue.put_nowait(TokenEvent(finish_reason=FinishReason.UNAVAILABLE, error=message))
            cancel()  # a worker that runs again drops it
        return len(waiting)

    async def fail_all(self, message: str) -> None:
        if self.core is not None and self.healthy:
            await self.run_on_worker(self.core.fail_all, message)

    def problem(self, stall_timeout: float, loading: bool) -> str | None:
        """Why the engine cannot serve (None: it can)."""
        worker = self.worker
        if worker.error is not None or (worker.ident is not None and not worker.is_alive()):
            return "inference worker died"
        # A model load is one long job on the worker; the heartbeat only counts once serving.
        if not loading and worker.ident is not None and time.monotonic() - worker.heartbeat > stall_timeout:
            return "inference worker stalled"
        return None

    def cache_gauges(self) -> CacheGauges:
        return self.core.cache_gauges() if self.core is not None else CacheGauges()

    async def stop(self) -> None:
        if self.core is not None and self.worker.is_alive():
            try:  # a hung worker never answers: end what waits on it here instead
                await asyncio.wait_for(self.run_on_worker(self.core.fail_all, "the server is shutting down"), 5.0)
            except Exception:  # noqa: BLE001 - timed out, or the worker is gone
                self.abandon("the server is shutting down")
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.stop_kernel_builds()
        if self.config.thread_guard and self.worker.ident is not None:
            GUARD.release(self.worker.ident)
