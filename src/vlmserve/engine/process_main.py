"""The engine process (`--engine-process`): model, core and MLX worker, served over a pipe.

A spawned process of its own, so the MLX thread's Python (graph building, detokenizing) never
competes with the serving process's event loop for one GIL. Its main thread reads the
server's messages (engine/messages.py); the MLX worker thread steps the engine core and,
after every step, sends that step's events, metric samples and counts back as one
StepOutput. process_client.py is the other side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

from vlmserve.config import ServerConfig
from vlmserve.engine import messages as msg
from vlmserve.engine.held_pixels import HeldPixels
from vlmserve.protocol import FinishReason, PreparedRequest, TokenEvent
from vlmserve.torchless import keep_torch_out

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle engine still reports this often (the server's stall check)
_STOP_WAIT_S = 10.0


class ForwardedHooks:
    """Scheduler hooks, recorded on the worker and sent with the step's events; the server
    applies them to its own SchedulerHooks (its Prometheus registry)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, tuple]] = []

    def on_admit(self, req) -> None:
        self.records.append(("on_queue_time", (time.monotonic() - req.arrival,)))

    def on_vision(self, seconds: float) -> None:
        self.records.append(("on_vision", (seconds,)))

    def on_prefill(self, seconds: float) -> None:
        self.records.append(("on_prefill", (seconds,)))

    def on_decode_step(self, seconds: float, batch: int) -> None:
        self.records.append(("on_decode_step", (seconds, batch)))

    def on_prefix_lookup(self, hit: bool, images: bool = False) -> None:
        self.records.append(("on_prefix_lookup", (hit, images)))

    def take(self) -> list[tuple[str, tuple]]:
        records, self.records = self.records, []
        return records


class EngineServer:
    def __init__(self, engine, conn, thread_guard: bool):
        self.engine = engine
        self.conn = conn
        self.thread_guard = thread_guard
        self.requests: dict[int, object] = {}  # key -> EngineRequest, until its final event
        self.inputs: dict[int, PreparedRequest] = {}  # inputs_key -> inputs, until released
        self.held = HeldPixels()  # pixels of earlier requests, by image content (held_pixels.py)
        self._outbox: list[tuple[int, TokenEvent]] = []  # worker thread only
        self._send_lock = threading.Lock()
        self._last_sent = 0.0
        self._violations_sent = 0
        engine.worker.after_work = self.flush
        engine.core.flush_events = self.flush

    def send(self, message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass  # the server is gone: the main thread sees the pipe close and stops

    # ---- worker thread --------------------------------------------------------------
    def _emitter(self, key: int):
        def emit(event: TokenEvent) -> None:
            self._outbox.append((key, event))
            if event.finish_reason is not None:
                self.requests.pop(key, None)

        return emit

    def flush(self) -> None:
        """One message per step: its events, metric samples and the counts admission needs."""
        records = self.engine.hooks.take()
        now = time.monotonic()
        if not self._outbox and not records and now - self._last_sent < HEARTBEAT_S:
            return
        events, self._outbox = self._outbox, []
        self._last_sent = now
        self.send(msg.StepOutput(events, records, self._stats()))

    def _stats(self) -> msg.EngineStats:
        engine = self.engine
        stats = msg.EngineStats(
            running=engine.core.num_running, gauges=engine.core.cache_gauges(), died=engine.worker.error is not None
        )
        if self.thread_guard:
            from vlmserve.engine.thread_guard import GUARD

            stats.violations = GUARD.violations[self._violations_sent :]
            self._violations_sent += len(stats.violations)
            stats.guard_calls = sum(GUARD.calls.values())
        return stats

    # ---- main thread ----------------------------------------------------------------
    def serve(self) -> None:
        """Read the server's messages until it says stop or goes away; then stop the worker."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, msg.AddRequest):
                self._add(message)
            elif isinstance(message, msg.CancelRequest):
                req = self.requests.get(message.key)
                if req is not None:
                    req.cancelled = True
                    self.engine.worker.wake()
            elif isinstance(message, msg.ReleaseInputs):
                self.inputs.pop(message.inputs_key, None)
            elif isinstance(message, msg.Call):
                self._call(message)
            elif isinstance(message, msg.Stop):
                break
        self.engine.worker.stop(_STOP_WAIT_S)  # its last act fails what is left and flushes

    def _add(self, add: msg.AddRequest) -> None:
        from vlmserve.engine.sched.request import EngineRequest

        if add.prepared is not None and self._restore_pixels(add):
            self.inputs[add.inputs_key] = add.prepared
        prepared = self.inputs.get(add.inputs_key)
        if prepared is None:  # its pixels were left out as held, and are not: never expected
            error = TokenEvent(finish_reason=FinishReason.ERROR, error="the request's image inputs were lost")
            self.send(msg.StepOutput([(add.key, error)], [], msg.EngineStats(running=self.engine.core.num_running)))
            return
        req = EngineRequest(add.request_id, prepared, add.sampling, self._emitter(add.key))
        self.requests[add.key] = req
        core, worker = self.engine.core, self.engine.worker
        core.add(req)
        worker.wake()
        if not worker.healthy:  # it died (or stopped) meanwhile: nobody would answer
            try:
                core.sched.inbox.remove(req)
            except ValueError:
                return  # the exiting worker took it and emits its error
            self.requests.pop(add.key, None)
            error = TokenEvent(finish_reason=FinishReason.UNAVAILABLE, error="the inference worker is not running")
            self.send(msg.StepOutput([(add.key, error)], [], msg.EngineStats(died=True)))

    def _restore_pixels(self, add: msg.AddRequest) -> bool:
        """Note the request's pixels as the serving side noted them (held_pixels.py); put back the
        ones it left out. False: they were left out but are not held (the two sides disagree)."""
        prepared = add.prepared
        pixels = HeldPixels.pixels(prepared.model_inputs)
        if not prepared.image_hashes or not (pixels or add.pixels_held):
            return True
        held = self.held.note(prepared.image_hashes, pixels, keep=True)
        if not add.pixels_held:
            return True
        if held is None:
            log.error("request %s: its pixels were left out as held, but they are not", add.request_id)
            return False
        prepared.model_inputs.update(held)
        return True

    def _call(self, call: msg.Call) -> None:
        if call.name not in CALLS:
            raise KeyError(call.name)
        future = self.engine.worker.submit(CALLS[call.name](self.engine), *call.args)

        def answer(done) -> None:
            exc = done.exception()
            if exc is not None:
                self.send(msg.CallResult(call.call_id, f"{type(exc).__name__}: {exc}"))
            else:
                self.send(msg.CallResult(call.call_id, None, done.result()))

        future.add_done_callback(answer)


# Jobs the server may run on the worker, by name.
CALLS = {
    "warm_up": lambda engine: engine.warm_up_on_worker,  # the kernel builds beside the load first
    "fail_all": lambda engine: engine.core.fail_all,
}


def main(conn, config: ServerConfig) -> None:
    """The spawned process's entry point."""
    # Ctrl-C and SIGTERM reach the whole process group: the server drains on them and still
    # needs this process meanwhile; it stops it itself (or, gone, closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = time.perf_counter()
    keep_torch_out()  # before transformers loads (torchless.py)
    from vlmserve.engine import side_builds
    from vlmserve.logging import start_logging

    logs = start_logging(config.log_level)
    # Before the imports below (seconds): on a first start the load's first forward needs
    # kernels these builds are making.
    side = side_builds.start_early(config.model)
    try:
        from vlmserve.engine.inprocess import Engine
    except BaseException:
        if side is not None:
            side_builds.stop(side)
        raise

    log.info(
        "engine process: MLX and the model libraries imported%s in %.1f s",
        " (kernel builds started first)" if side is not None and (side.qmm or side.indexing) else "",
        time.perf_counter() - started,
    )
    if config.gil_switch_interval_ms > 0:
        sys.setswitchinterval(config.gil_switch_interval_ms / 1000)
    engine = Engine(config, hooks=ForwardedHooks(), side=side)
    code = 0
    try:
        asyncio.run(engine.start())
    except BaseException as exc:  # noqa: BLE001 - the reason goes to the server, which exits with it
        conn.send(msg.LoadFailed(f"{type(exc).__name__}: {exc}"))
        code = 1
    else:
        server = EngineServer(engine, conn, config.thread_guard)
        conn.send(msg.Ready(engine.info, str(engine.model_path), engine.core.cache_gauges()))
        server.serve()
    engine.stop_kernel_builds()  # none outlives the engine: os._exit below skips every teardown
    logs.stop()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Not the interpreter's teardown: with MLX streams made on the worker it can abort (cli._exit_now).
    os._exit(code)
