"""Admission to preprocessing: how much work may wait for the CPU, and which pool takes a request.

A request counts in requests against --max-pending-preprocess from admission until its
preprocessing job ends, and each of its choices (`n`) against --max-waiting, together with the
engine's own waiting requests, until the engine counts it there: a `ChoiceHold` per choice goes
with the prepared request and is released when the choice is handed over (or dropped unstarted).
With --preprocess-processes a request goes to this process's thread pool or to the
preprocessing processes (pool.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from vlmserve.config import ServerConfig
from vlmserve.inputs.pool import PreprocessProcesses
from vlmserve.inputs.preprocess import Preprocessor
from vlmserve.metrics import Metrics
from vlmserve.protocol import ChatRequest, EngineError, PreparedRequest

QUEUE_FULL_MESSAGE = "too many requests are waiting; retry later"


def queue_full() -> EngineError:
    """429: the HTTP layer adds `retry-after`."""
    return EngineError(QUEUE_FULL_MESSAGE, code="queue_full", status=429)


class ChoiceHold:
    """One admitted choice counted against --max-waiting until the engine counts it. A response
    starts reading its choices after its headers are out, so without the hold a burst of
    streams passed the check while counted nowhere. Released once: by the engine client when
    it registers the choice, or when the hold is dropped (a choice never started)."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]):
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    __del__ = release


class Admission:
    # With --preprocess-processes, this many requests at a time still preprocess on the thread
    # pool, the rest go to the processes: alone, a request pays no pickling (c=1 TTFT), and one
    # thread's GIL share is small; a burst is what the processes are for.
    in_process_preprocess_limit = 1

    def __init__(self, config: ServerConfig, metrics: Metrics, engine_waiting: Callable[[], int]):
        self.config = config
        self.metrics = metrics
        self._engine_waiting = engine_waiting  # requests the engine holds but has not started
        self.preprocessor: Preprocessor | None = None  # set once the model's processor is loaded
        self.processes: PreprocessProcesses | None = None  # --preprocess-processes
        # Admitted requests not yet handed to the engine (queued for or inside the CPU pool).
        # Re-entrant: a dropped ChoiceHold releases from its finalizer, which the garbage
        # collector may run on a thread that holds the lock already.
        self._lock = threading.RLock()
        self.pending_choices = 0
        self.pending_requests = 0
        self._in_process_jobs = 0  # of those, preprocessing on this process's thread pool

    def check_capacity(self, n: int) -> None:
        """429 when n more choices would push the waiting work past max_waiting; 400 when n alone
        is past it (no wait would let it in)."""
        if n > self.config.max_waiting:
            raise EngineError(
                f"'n' must be at most {self.config.max_waiting} on this server (--max-waiting)", param="n"
            )
        if self._engine_waiting() + self.pending_choices + n > self.config.max_waiting:
            raise queue_full()

    def reserve(self, n: int) -> bool:
        """Count the request as pending; True when it is to preprocess on the thread pool."""
        # Runs on the event loop with no await between check and increment: a burst cannot
        # all pass the check before any of it is counted.
        with self._lock:
            self.check_capacity(n)
            if self.pending_requests + 1 > self.config.max_pending_preprocess:
                raise queue_full()
            self.pending_choices += n
            self.pending_requests += 1
            in_process = self.processes is None or self._in_process_jobs < self.in_process_preprocess_limit
            self._in_process_jobs += in_process
        self.metrics.preprocessed("threads" if in_process else "processes")
        return in_process

    def release_choices(self, n: int) -> None:  # any thread
        with self._lock:
            self.pending_choices -= n

    def end_job(self, in_process: bool) -> None:  # a request's pool job ended (any thread)
        with self._lock:
            self.pending_requests -= 1
            self._in_process_jobs -= in_process

    async def prepare(self, chat: ChatRequest) -> tuple[PreparedRequest, list[ChoiceHold]]:
        """Admission (429 past --max-waiting / --max-pending-preprocess) + CPU preprocessing; the
        prepared request and a hold for each of its choices (see the module's doc).

        A request that fails or is cancelled here keeps its places until its pool job ends, not
        only until this await ends, so a client that leaves cannot make room while its work
        still occupies the pool.
        """
        self.preprocessor.check_text_length(chat)  # before any slot, fetch or tokenizing
        in_process = self.reserve(chat.n)
        t0 = time.perf_counter()
        job = {"running": True, "abandoned": False}  # who comes second releases the choices

        def done() -> None:  # the pool job ended (any thread)
            self.metrics.preprocess.observe(time.perf_counter() - t0)
            with self._lock:
                self.end_job(in_process)
                job["running"] = False
                if job["abandoned"]:
                    self.release_choices(chat.n)

        try:
            if in_process:
                prepared = await self._prepare_in_process(chat, done)
            else:
                prepared = await self.processes.prepare(chat, on_done=done)
        except BaseException:
            with self._lock:
                job["abandoned"] = True
                if not job["running"]:
                    self.release_choices(chat.n)
            raise
        return prepared, [ChoiceHold(lambda: self.release_choices(1)) for _ in range(chat.n)]

    async def _prepare_in_process(self, chat: ChatRequest, done: Callable[[], None]) -> PreparedRequest:
        try:
            images = await self.preprocessor.fetch_images(chat)
        except BaseException:
            done()
            raise

        try:
            future = self.preprocessor.pool.submit(self.preprocessor.encode_chat, chat, images)
        except BaseException:
            done()
            raise
        # When the job ends, or is cancelled before it starts (this await cancelled meanwhile).
        future.add_done_callback(lambda _: done())
        return await asyncio.wrap_future(future)
