"""MLXWorkerThread: the one thread that touches MLX (invariant 1).

It runs submitted calls (model load, warm-up, tests' probes) and, between them, the
engine core's steps. Other threads only enqueue work and wake it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # heartbeat period while idle


class WorkerDied(RuntimeError):
    pass


class MLXWorkerThread(threading.Thread):
    def __init__(self, name: str = "mlx-worker"):
        super().__init__(name=name, daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.core = None  # set on this thread once the model is loaded
        self.after_work: Callable[[], None] | None = None  # e.g. deliver the step's events in one batch
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self.closed = False  # set before the final fail_all; healthy is False from then on

    # ---- any thread --------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run fn on the worker; await it from asyncio with `asyncio.wrap_future`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None or not self.is_alive() and self._started.is_set():
            future.set_exception(WorkerDied("MLX worker is not running"))
            return future
        self._jobs.put((fn, args, kwargs, future))
        return future

    def wake(self) -> None:
        self._jobs.put(None)

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping.set()
        self.wake()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.is_alive() and self.error is None and not self.closed

    # ---- worker thread -------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.heartbeat = time.monotonic()
                busy = self.core is not None and self.core.has_work()
                idle_work = not busy and self.core is not None and self.core.has_idle_work()
                self._run_jobs(block=not (busy or idle_work))
                if self.core is not None:
                    if self.core.has_work():
                        self.core.step()
                    elif self.core.has_idle_work():
                        self.core.idle_work()
                    else:
                        self.core.release_idle_memory()
                if self.after_work is not None:
                    self.after_work()
        except BaseException as exc:  # noqa: BLE001 - the worker must report its death, whatever it was
            self.error = exc
            log.exception("MLX worker died")
            self.closed = True
            if self.core is not None:
                self.core.fail_all("the inference worker stopped unexpectedly")
        finally:
            self.closed = True
            if self.core is not None:  # requests added while stopping: wake them, never leave them waiting
                try:
                    self.core.fail_all("the inference worker stopped")
                except Exception:  # noqa: BLE001
                    log.exception("failing the remaining requests")
            if self.after_work is not None:
                self.after_work()
            self._fail_pending()

    def _run_jobs(self, *, block: bool) -> None:
        try:
            item = self._jobs.get(timeout=_IDLE_WAIT_S) if block else self._jobs.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                fn, args, kwargs, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                        future.set_exception(exc)
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item[3].done():
                item[3].set_exception(WorkerDied("MLX worker stopped"))
