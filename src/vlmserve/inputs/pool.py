"""Preprocessing in spawned processes (`--preprocess-processes N`), off the serving process's GIL.

A W1 request holds the GIL for ~3 ms of its preprocessing (base64, the chat template, the
processor's Python, pixel packing). On a thread pool that competes with the event loop
(`/health`, every stream's writes) and the MLX thread for one GIL; in a process of its own it
does not. Each process loads its own processor and runs the whole of a request's CPU work:
fetch, decode, template, tokenize, pixels. Only the ChatRequest goes in and the
PreparedRequest (NumPy) comes back, by pickle.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from vlmserve.config import ServerConfig
from vlmserve.protocol import ChatRequest, EngineError, PreparedRequest
from vlmserve.torchless import keep_torch_out

log = logging.getLogger(__name__)

_preprocessor = None  # the process's own Preprocessor, made by _start_process


def _start_process(
    model_path: str,
    context_length: int,
    config: ServerConfig,
    pixel_dtype: str | None,
    model_type: str | None,
    whole_prefixes: bool,
    server_pid: int,
) -> None:
    global _preprocessor
    # Ctrl-C and a service manager's SIGTERM reach the whole process group. The server drains on
    # them and still needs its preprocessing meanwhile; it ends these processes itself (and a
    # process whose server died exits when its work queue closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The server's pid as the server saw it: one that died before this ran is not mistaken for init.
    threading.Thread(target=_exit_with_parent, args=(server_pid,), name="parent-watch", daemon=True).start()
    keep_torch_out()  # before transformers loads (torchless.py)
    from vlmserve.inputs.preprocess import Preprocessor, warmup_chats
    from vlmserve.models.processor import load_processor  # loads files only; no MLX work

    _preprocessor = Preprocessor(
        load_processor(Path(model_path)), context_length, config, pixel_dtype, model_type, whole_prefixes
    )
    if config.warmup:  # first use (template compile, decoder plugins) on start-up's time, not a request's
        for _, chat in warmup_chats(config.warmup_image_sizes):
            _preprocessor.prepare_sync(chat)


def _exit_with_parent(parent: int, period: float = 1.0) -> None:
    """Exit once the server is gone. Waiting for the work queue to close is not enough: every
    worker holds that queue's write end too, so after a sibling died and the server exited
    without ending the pool, the others waited forever (orphans)."""
    while os.getppid() == parent:
        time.sleep(period)
    os._exit(0)


def _started() -> bool:
    return _preprocessor is not None


def _prepare(chat: ChatRequest) -> PreparedRequest:
    return _preprocessor.prepare_sync(chat)


class PreprocessProcesses:
    def __init__(
        self,
        model_path: Path,
        context_length: int,
        config: ServerConfig,
        pixel_dtype: str | None,
        model_type: str | None = None,
        whole_prefixes: bool = False,
    ):
        """`model_type`, `whole_prefixes` (ModelInfo's): as for Preprocessor."""
        self.processes = config.preprocess_processes
        self._args = (str(model_path), context_length, config, pixel_dtype, model_type, whole_prefixes, os.getpid())
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the serving process has threads (and, on a GPU, a device context).
        return ProcessPoolExecutor(
            self.processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_process,
            initargs=self._args,
        )

    async def start(self) -> None:
        """Start every process now (the pool would start them on demand, on requests' time)."""
        try:
            await asyncio.gather(*(asyncio.wrap_future(self._pool.submit(_started)) for _ in range(self.processes)))
        except BrokenProcessPool:
            self.close()
            raise RuntimeError("a preprocessing process failed to start (its traceback is above)") from None

    async def prepare(self, chat: ChatRequest, on_done: Callable[[], None]) -> PreparedRequest:
        """One request's preprocessing; on_done runs when its job ends, even if this await is cancelled."""
        pool = self._pool
        try:
            try:
                future = pool.submit(_prepare, chat)
            except BaseException:
                on_done()
                raise
            future.add_done_callback(lambda _: on_done())
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            # A process died (killed, out of memory) and took the pool's queue with it: answer
            # this request, and give the next ones a new pool.
            if self._pool is pool:
                log.error("a preprocessing process died; starting a new pool")
                self._pool = self._new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise EngineError(
                "a preprocessing process stopped; retry the request", code="preprocess_failed", status=503
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
