"""The HTTP process's side of `--engine-process`: the engine's interface, over a pipe.

In one process the event loop and the MLX thread share a GIL. Every socket read or write on
the loop releases it, and getting it back can mean waiting a switch interval while the MLX
thread builds its next graph in Python: at 64 streams that stalled the loop (and `/health`)
by 16-66 ms on the H100. Here the MLX worker lives in a spawned process (process_main.py,
vLLM's engine-core split), and this process keeps HTTP, admission and preprocessing.

Two threads of this process talk to it: a writer (pickling a request's pixels off the loop)
and a reader that hands each step's message to the loop in one thread-safe call.
No MLX is imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from vlmserve.config import ServerConfig
from vlmserve.engine import messages as msg
from vlmserve.engine import process_main as engine_process
from vlmserve.engine.event_stream import read_events
from vlmserve.engine.held_pixels import HeldPixels
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

# Hooks the engine process may ask this side to apply (metrics.SchedulerHooks' methods).
_HOOKS = frozenset({"on_queue_time", "on_vision", "on_prefill", "on_decode_step", "on_prefix_lookup"})
_JOIN_S = 15.0


class EngineProcessClient:
    """The EngineClient (engine/client.py) of an engine in its own process."""

    def __init__(self, config: ServerConfig, hooks=None):
        self.config = config
        self.hooks = hooks
        self.info: ModelInfo | None = None
        self.model_path: Path | None = None
        self.process: multiprocessing.Process | None = None
        self.guard_violations: list = []  # MLX calls off the engine's worker (with the thread guard on)
        self.guard_calls = 0  # MLX calls the engine's thread guard has checked
        self._conn = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._reap_lock = threading.Lock()  # one thread at a time waits for the process (waitpid)
        self._streams: dict[int, asyncio.Queue] = {}  # event loop only, like everything below
        self._calls: dict[int, asyncio.Future] = {}
        self._inputs: dict[int, list[int]] = {}  # id(PreparedRequest) -> [inputs_key, requests using it]
        self._held = HeldPixels()  # what the engine process holds of pixels sent before (held_pixels.py)
        self._ready: asyncio.Future | None = None
        self._next_key = 0
        self._running = 0
        self._gauges = CacheGauges()
        self._last_heard = time.monotonic()
        self._worker_died = False
        self._gone = False  # the process exited or closed its pipe

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the process and wait until its model is loaded; raises with its reason if not."""
        loop = self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # not fork: this process has threads
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=engine_process.main, args=(child_conn, self.config), name="vlmserve-engine", daemon=True
        )
        self._ready = loop.create_future()
        self._held = HeldPixels()  # a new process holds none
        await loop.run_in_executor(None, self.process.start)
        child_conn.close()
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="engine-writer", daemon=True).start()
        try:
            info, path = await self._ready
        except BaseException:
            self._gone = True
            await loop.run_in_executor(None, self._end_process, 0.0)
            raise
        self.info, self.model_path = info, Path(path)
        self._last_heard = time.monotonic()

    async def stop(self) -> None:
        if self.process is None:
            return
        # A hung engine would never answer: kill it after a moment instead of waiting it out.
        answering = self.healthy and self.problem(self.config.stall_timeout, loading=False) is None
        if answering:
            try:
                await asyncio.wait_for(self.fail_all("the server is shutting down"), _JOIN_S)
            except Exception:  # noqa: BLE001 - it may be gone already
                pass
        self.abandon("the server is shutting down")
        self._outgoing.put(msg.Stop())
        self._outgoing.put(None)  # the writer's end
        wait = _JOIN_S if answering else 1.0
        await asyncio.get_running_loop().run_in_executor(None, self._end_process, wait)

    def _end_process(self, wait: float) -> None:
        with self._reap_lock:
            self.process.join(wait)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)

    # ---- health and counts -------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.process is not None and not self._gone and not self._worker_died

    def problem(self, stall_timeout: float, loading: bool) -> str | None:
        """Why the engine cannot serve (None: it can)."""
        if self.process is None:
            return None
        if self._gone or self._worker_died:
            return "inference worker died"
        # The engine reports at least every HEARTBEAT_S between steps; loading is one long job.
        if not loading and time.monotonic() - self._last_heard > stall_timeout:
            return "inference worker stalled"
        return None

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        """Requests handed over and not yet running there (including those still in the pipe)."""
        return max(0, len(self._streams) - self._running)

    def cache_gauges(self) -> CacheGauges:
        return self._gauges

    # ---- requests ----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prepared: PreparedRequest,
        sampling: SamplingParams,
        registered: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream one request's events; leaving the iterator early cancels the request."""
        if not self.healthy or self.info is None:
            raise EngineError("the inference worker is not running", code="worker_unavailable", status=503)
        key = self._next_key
        self._next_key += 1
        events_in: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[key] = events_in
        self._outgoing.put(msg.AddRequest(key, request_id, sampling, *self._shipped_inputs(prepared)))
        if registered is not None:  # num_waiting counts it from here (its stream is open)
            registered()
        events = read_events(events_in, lambda: self._outgoing.put(msg.CancelRequest(key)))
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # now, not when collected: a reader that left cancels at once
            self._streams.pop(key, None)
            self._unshare_inputs(prepared)

    def _share_inputs(self, prepared: PreparedRequest) -> tuple[int, PreparedRequest | None]:
        """(inputs_key, the inputs or None when the engine has them already): the choices of one
        request pass one PreparedRequest, and its arrays cross the pipe once."""
        entry = self._inputs.get(id(prepared))
        if entry is not None:
            entry[1] += 1
            return entry[0], None
        self._inputs[id(prepared)] = [self._next_key, 1]
        self._next_key += 1
        return self._inputs[id(prepared)][0], prepared

    def _shipped_inputs(self, prepared: PreparedRequest) -> tuple[int, PreparedRequest | None, bool]:
        """(inputs_key, the inputs to send, whether their pixel arrays were left out as held)."""
        inputs_key, shipped = self._share_inputs(prepared)
        pixels = HeldPixels.pixels(shipped.model_inputs) if shipped is not None and shipped.image_hashes else {}
        if not pixels or self._held.note(shipped.image_hashes, pixels) is None:
            return inputs_key, shipped, False
        rest = {k: v for k, v in shipped.model_inputs.items() if k not in pixels}
        return inputs_key, dataclasses.replace(shipped, model_inputs=rest), True

    def _unshare_inputs(self, prepared: PreparedRequest) -> None:
        entry = self._inputs[id(prepared)]
        entry[1] -= 1
        if entry[1] == 0:  # the object stays alive while counted, so its id is not reused meanwhile
            del self._inputs[id(prepared)]
            self._outgoing.put(msg.ReleaseInputs(entry[0]))

    async def warm_up(self, prompts: list[PreparedRequest]) -> None:
        gauges = await self._call("warm_up", prompts)
        if isinstance(gauges, CacheGauges):  # as warm-up left them: fresher than the last report
            self._gauges = gauges

    async def fail_all(self, message: str) -> None:
        if self.healthy:
            await self._call("fail_all", message)

    def abandon(self, message: str) -> int:
        lost = TokenEvent(finish_reason=FinishReason.UNAVAILABLE, error=message)
        streams, self._streams = self._streams, {}  # what the engine sends for them later finds no stream
        for key, stream in streams.items():
            stream.put_nowait(lost)
            self._outgoing.put(msg.CancelRequest(key))  # an engine that runs again drops them
        return len(streams)

    async def _call(self, name: str, *args):
        if not self.healthy:
            raise EngineError("the inference worker is not running", code="worker_unavailable", status=503)
        call_id = self._next_key
        self._next_key += 1
        answer = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        self._outgoing.put(msg.Call(call_id, name, args))
        try:
            return await answer
        finally:
            self._calls.pop(call_id, None)

    # ---- the pipe's threads ----------------------------------------------------------------
    def _write(self) -> None:
        while True:
            message = self._outgoing.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the process is gone; the reader reports it

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                self._to_loop(self._on_message, message)
        except (EOFError, OSError):
            pass
        with self._reap_lock:
            self.process.join(5)  # its exit code, for the log
        self._to_loop(self._on_gone, self.process.exitcode)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    # ---- event loop ------------------------------------------------------------------------
    def _on_message(self, message) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, msg.StepOutput):
            for key, event in message.events:
                stream = self._streams.get(key)
                if stream is not None:
                    stream.put_nowait(event)
            if self.hooks is not None:
                for name, args in message.hook_records:
                    if name in _HOOKS:
                        getattr(self.hooks, name)(*args)
            stats = message.stats
            self._running = stats.running
            self._gauges = stats.gauges
            self._worker_died = self._worker_died or stats.died
            if stats.guard_calls is not None:
                self.guard_calls = stats.guard_calls
            if stats.violations:
                self.guard_violations.extend(stats.violations)
                log.error("MLX calls off the engine's worker thread: %s", stats.violations[:5])
        elif isinstance(message, msg.CallResult):
            answer = self._calls.get(message.call_id)
            if answer is not None and not answer.done():
                if message.error is not None:
                    answer.set_exception(RuntimeError(message.error))
                else:
                    answer.set_result(message.value)
        elif isinstance(message, msg.Ready):
            if not self._ready.done():
                if message.gauges is not None:
                    self._gauges = message.gauges
                self._ready.set_result((message.info, message.model_path))
        elif isinstance(message, msg.LoadFailed) and not self._ready.done():
            self._ready.set_exception(RuntimeError(message.reason))

    def _on_gone(self, exit_code: int | None) -> None:
        self._gone = True
        self._running, self._gauges = 0, CacheGauges()  # nothing runs there any more: the gauges say so
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                RuntimeError(f"the engine process exited (code {exit_code}) before the model was loaded")
            )
            return
        if self._streams or exit_code != 0:
            log.error("the engine process exited (code %s)", exit_code)
        lost = TokenEvent(finish_reason=FinishReason.UNAVAILABLE, error="the inference worker stopped unexpectedly")
        for stream in self._streams.values():
            stream.put_nowait(lost)
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(
                    EngineError("the inference worker is not running", code="worker_unavailable", status=503)
                )
