"""Starlette app factory and lifespan: load + warm the model, report ready, drain on exit."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import StreamingResponse
from starlette.routing import Route

from vlmserve.config import ServerConfig
from vlmserve.engine.client import EngineClient, create_engine_client
from vlmserve.entrypoints.openai import tool_use
from vlmserve.entrypoints.openai.chat_request import model_aliases
from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeMiddleware,
    BrowserGuardMiddleware,
    is_loopback,
)
from vlmserve.entrypoints.openai.routes import method_not_allowed, not_found, routes
from vlmserve.inputs.admission import Admission, ChoiceHold
from vlmserve.inputs.pool import PreprocessProcesses
from vlmserve.inputs.preprocess import Preprocessor, warmup_chats
from vlmserve.metrics import Metrics, SchedulerHooks
from vlmserve.models.paths import resolve_model_path
from vlmserve.models.processor import load_processor
from vlmserve.protocol import ChatRequest, EngineError, FinishReason, PreparedRequest

log = logging.getLogger("vlmserve")

SHUTDOWN_MESSAGE = "the server is shutting down"
_LOOP_EXECUTOR_THREADS = 4
_ENGINE_ANSWER_S = 5.0  # how long shutdown waits for the engine to end its requests itself
_WARM_POLL_S = 0.5  # --exit-when-warm: how often warmup_pending is read (the engine reports as often)
_CRASH_WINDOW_S = 600.0  # engine deaths and failed starts within this count towards --engine-restarts


def _start_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start a pool's n threads now. A pool starts one thread per submit while none is idle, and
    Thread.start() waits until the new thread runs: on the event loop, under load, that means
    waiting for the GIL (loop stalls during the first big burst, seen on the H100)."""
    barrier = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(barrier.wait, 10)
    barrier.wait(10)


async def _warm_streaming_response() -> None:
    """Stream one response through a throwaway Starlette app, in-process.

    Starlette runs a streamed response in an anyio task group, and anyio imports its asyncio
    backend on first use: 30-50 ms on the event loop of the first real request (its TTFT, and
    any /health probe beside it), seen on the H100. Warm-up's own jobs never touch HTTP.
    """
    app = Starlette(routes=[Route("/", lambda request: StreamingResponse(iter([b"warm"])))])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warmup") as client:
        await client.get("/")


class ServerState:
    """Everything a route needs, in one object on app.state.server."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics(config.model_id)
        self.hooks = SchedulerHooks(self.metrics)
        # --engine-process: the MLX worker in a process of its own, and this process never
        # imports the engine's model, scheduler or worker (engine/client.py)
        self.engine: EngineClient = create_engine_client(config, self.hooks)
        # Admission to preprocessing (429s, pending counts) and the pools it hands requests to.
        self.admission = Admission(config, self.metrics, lambda: self.engine.num_waiting)
        self.ready = False
        self.loading = True
        self.load_error: str | None = None
        self._deaths: list[float] = []  # when the engine died or failed to start again (monotonic)
        self.draining = False  # stop admitting; /ready 503
        self.closed = False  # drain over: anything still arriving gets an error
        self.created = int(time.time())
        # Once, not per request: deriving them stats the model path (the event loop's time).
        self._model_id = config.model_id
        self._model_names = frozenset(model_aliases(config))  # the served name is one of them
        self._tool_parser = None
        self._feature_seen = (0, 0)  # the engine's feature-cache counts already counted
        # Replaced by the CLI: make uvicorn exit (a failed load, or --exit-when-warm); the exit
        # status follows load_error. An embedded server has nothing to stop.
        self.stop_serving: Callable[[], None] = lambda: None
        self._exit_task: asyncio.Task | None = None
        self._load_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None

    # ---- identity ----------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def model_names(self) -> frozenset[str]:
        """Names a request may use (the served name and its aliases)."""
        return self._model_names

    @property
    def context_length(self) -> int:
        return self.engine.info.context_length

    @property
    def max_images(self) -> int:
        """Images one request may carry: --max-images-per-request, or fewer where the model reads fewer."""
        family_limit = self.preprocessor.adapter.max_images if self.preprocessor is not None else None
        limit = self.config.max_images_per_request
        return limit if family_limit is None else min(limit, family_limit)

    @property
    def chat_template(self) -> str | None:
        return self.preprocessor.chat_template if self.preprocessor is not None else None

    @property
    def tool_parser(self):
        """The format of this model's tool calls (tool_use.choose_parser), chosen once."""
        if self._tool_parser is None:
            self._tool_parser = tool_use.choose_parser(self.config.tool_call_parser, self.chat_template)
        return self._tool_parser

    # ---- preprocessing (inputs/admission.py holds it) -------------------------------
    @property
    def preprocessor(self) -> Preprocessor | None:
        return self.admission.preprocessor

    @preprocessor.setter
    def preprocessor(self, preprocessor: Preprocessor | None) -> None:
        self.admission.preprocessor = preprocessor

    @property
    def preprocess_processes(self) -> PreprocessProcesses | None:  # --preprocess-processes
        return self.admission.processes

    @preprocess_processes.setter
    def preprocess_processes(self, processes: PreprocessProcesses | None) -> None:
        self.admission.processes = processes

    @property
    def pending_choices(self) -> int:
        """Choices admitted but not yet handed to the engine (queued for or inside the CPU pool)."""
        return self.admission.pending_choices

    @property
    def pending_requests(self) -> int:
        return self.admission.pending_requests

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Load, warm up, report ready. Raises with the reason if any of it fails."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        # The loop's own executor (large request bodies are parsed there, request_body.py): GIL-bound
        # work, so a few threads, all started now.
        executor = ThreadPoolExecutor(_LOOP_EXECUTOR_THREADS, thread_name_prefix="loop-executor")
        loop.set_default_executor(executor)
        _start_threads(executor, _LOOP_EXECUTOR_THREADS)
        try:
            log.info("starting the engine (%s)", "its own process" if self.config.engine_process else "in this process")
            # The processor loads here while the engine loads the weights (both take seconds).
            model_path = await loop.run_in_executor(None, resolve_model_path, self.config.model)

            async def engine_up() -> None:
                await self._timed("engine up", self.engine.start())

            async def processor_up():
                return await self._timed("processor loaded", loop.run_in_executor(None, load_processor, model_path))

            if self.config.engine_process:
                # Beside an engine process only: in one process both would import transformers at
                # once from two threads, which its lazy imports do not survive.
                outcomes = await asyncio.gather(engine_up(), processor_up(), return_exceptions=True)
                for outcome in outcomes:  # the engine's reason first: it names an unknown model
                    if isinstance(outcome, BaseException):
                        raise outcome
                processor = outcomes[1]
            else:
                await engine_up()
                processor = await processor_up()
            self.preprocessor = Preprocessor(
                processor,
                self.engine.info.context_length,
                self.config,
                pixel_dtype=self.engine.info.pixel_dtype,
                model_type=self.engine.info.model_type,
                whole_prefixes=self.engine.info.whole_prefixes,
            )
            _start_threads(self.preprocessor.pool, self.config.preprocess_workers)
            _start_threads(self.preprocessor.fetch_pool, self.preprocessor.fetch_workers)
            # The preprocessing processes start (each loads the processor) while warm-up runs.
            jobs = []
            if self.config.preprocess_processes > 0:
                self.preprocess_processes = PreprocessProcesses(
                    self.engine.model_path,
                    self.engine.info.context_length,
                    self.config,
                    self.engine.info.pixel_dtype,
                    self.engine.info.model_type,
                    self.engine.info.whole_prefixes,
                )
                label = f"{self.config.preprocess_processes} preprocessing processes up"
                jobs.append(self._timed(label, self.preprocess_processes.start()))
            if self.config.warmup:
                jobs.append(self._timed("warm-up done", self.warmup()))
            await asyncio.gather(*jobs)
        finally:
            self.loading = False
        if self.draining:
            return
        # The ~100k long-lived objects of the model, tokenizer and processor would make every
        # full GC pass a 50-150 ms stop-the-world pause (seen as /health spikes); freeze them.
        gc.freeze()
        self.ready = True
        log.info("ready: %s (%s) in %.2f s", self.model_id, self.engine.info.model_type, time.perf_counter() - t0)
        if self.config.exit_when_warm:
            self._exit_task = asyncio.create_task(self._exit_once_warm(t0), name="vlmserve-exit-when-warm")

    async def _exit_once_warm(self, t0: float) -> None:
        """--exit-when-warm: once no warm-up is left (`warmup_pending` 0 on three readings in a
        row: the kernels this start built are filed in the kernel cache), stop the server, exit
        status 0. An engine that fails meanwhile makes it a failed start (status 1)."""
        quiet = 0
        while quiet < 3:
            await asyncio.sleep(_WARM_POLL_S)
            if self.draining:
                return
            problem = self.engine.problem(self.config.stall_timeout, False)
            if problem is not None:
                self.load_error = f"the engine failed before it was fully warm: {problem}"
                log.error("--exit-when-warm: %s", self.load_error)
                break
            idle = self.ready and self.engine.cache_gauges().warmup_pending == 0
            quiet = quiet + 1 if idle else 0
        else:
            log.info(
                "fully warm in %.1f s, its kernels in the kernel cache: exiting (--exit-when-warm)",
                time.perf_counter() - t0,
            )
        self.stop_serving()

    @staticmethod
    async def _timed(what: str, awaitable):
        t0 = time.perf_counter()
        result = await awaitable
        log.info("%s in %.1f s", what, time.perf_counter() - t0)
        return result

    def start_in_background(self) -> None:
        """Listen while loading: /health 200, /ready and /v1 503 until the model is warm."""

        async def load() -> None:
            try:
                await self.start()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - reported, then the process exits non-zero
                self.load_error = f"{type(exc).__name__}: {exc}"
                log.error("failed to load %s: %s", self.config.model, exc)
                self.stop_serving()

        self._load_task = asyncio.create_task(load(), name="vlmserve-load")

    async def warmup(self, engine: EngineClient | None = None) -> None:
        """The engine builds the shapes traffic will use (EngineCore.warm_up) from a text prompt and
        one image per --warmup-image-sizes, prepared here as PNG data URIs through the same
        fetch/decode/process path as a client's, so the first real request does not pay that
        path's first use either (decoder plugins, caches)."""
        await _warm_streaming_response()
        loop = asyncio.get_running_loop()
        prompts = []
        for _, chat in warmup_chats(self.config.warmup_image_sizes):
            images = await self.preprocessor.fetch_images(chat)
            prompts.append(
                await loop.run_in_executor(self.preprocessor.pool, self.preprocessor.encode_chat, chat, images)
            )
        await (engine or self.engine).warm_up(prompts)

    @property
    def in_flight(self) -> int:
        return self.engine.num_running + self.engine.num_waiting + self.pending_choices

    async def drain(self) -> None:
        """Stop admitting, let admitted requests finish (up to drain_timeout), then end the rest.

        Idempotent: the signal handler and the lifespan shutdown may both call it.
        """
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="vlmserve-drain")
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        self.draining = True
        self.ready = False
        t0 = time.monotonic()
        deadline = t0 + self.config.drain_timeout
        if self.in_flight:
            log.info("draining: %d request(s) in flight, up to %.1f s", self.in_flight, self.config.drain_timeout)
        while self.in_flight > 0 and time.monotonic() < deadline and (self.loading or self.engine.healthy):
            await asyncio.sleep(0.05)
        self.closed = True
        left = self.in_flight
        if left:
            log.warning("drain timeout: ending %d request(s) with an error", left)
        try:  # a hung engine never answers: the requests still waiting end here
            await asyncio.wait_for(self.engine.fail_all(SHUTDOWN_MESSAGE), _ENGINE_ANSWER_S)
        except Exception:  # noqa: BLE001 - timed out, or the engine is gone
            self.engine.abandon(SHUTDOWN_MESSAGE)
        log.info("drained in %.2f s", time.monotonic() - t0)

    async def watch_engine(self, period: float = 0.5) -> None:
        """An engine that stops answering (hung, not dead) would hold every request forever:
        past --stall-timeout its requests end with a retryable 503 (admission refuses new ones
        meanwhile, check_accepting), and they are served again once it answers."""
        while True:
            await asyncio.sleep(period)
            if self.loading or self.draining or self.load_error is not None:
                continue
            problem = self.engine.problem(self.config.stall_timeout, self.loading)
            if problem == "inference worker died":
                await self._restart_engine()
            elif problem == "inference worker stalled":
                ended = self.engine.abandon(
                    f"the inference worker stalled (no answer for {self.config.stall_timeout:g} s)"
                )
                if ended:
                    log.error("inference worker stalled: ended %d request(s) with a retryable error", ended)

    async def _restart_engine(self) -> None:
        """Start a dead engine process again (its requests have ended with a retryable 503),
        warm it up and serve again. The new engine takes requests only once warm; until then
        /ready and chat answer 503. More than --engine-restarts deaths or failed starts within
        _CRASH_WINDOW_S (a crash loop), or a dead in-process engine (its model would stay in
        this process beside the new one), exit non-zero for the supervisor (systemd's Restart=,
        Kubernetes) to take over."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < _CRASH_WINDOW_S] + [now]
        if not self.config.engine_process:
            return self._give_up("the inference worker died")
        self.ready, self.loading = False, True
        dead = self.engine
        while len(self._deaths) <= self.config.engine_restarts:
            attempt = len(self._deaths)
            log.error("the engine died; starting it again (%d/%d)", attempt, self.config.engine_restarts)
            with contextlib.suppress(Exception):
                await dead.stop()  # reap what is left of it
            t0 = time.perf_counter()
            engine = create_engine_client(self.config, self.hooks)
            try:
                await engine.start()
                if self.config.warmup:
                    await self.warmup(engine)
            except Exception as exc:  # noqa: BLE001 - logged; the next try backs off
                log.error("starting the engine again failed: %s", exc)
                dead = engine
                self._deaths.append(time.monotonic())
                if len(self._deaths) <= self.config.engine_restarts:
                    await asyncio.sleep(4 ** (attempt - 1))
                continue
            self.engine = engine
            if self.draining:
                return
            self.ready, self.loading = True, False
            log.info("engine started again in %.1f s; serving", time.perf_counter() - t0)
            return
        with contextlib.suppress(Exception):
            await dead.stop()
        self._give_up(f"the engine died or failed to start {len(self._deaths)} times within {_CRASH_WINDOW_S:g} s")

    def _give_up(self, reason: str) -> None:
        self.load_error, self.loading = reason, False
        log.error("%s; exiting", reason)
        self.stop_serving()

    async def stop(self) -> None:
        await self.drain()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            await asyncio.gather(self._load_task, return_exceptions=True)
        await self.engine.stop()
        if self.preprocessor is not None:
            self.preprocessor.close()
        if self.preprocess_processes is not None:
            self.preprocess_processes.close()

    # ---- admission -------------------------------------------------------------------
    def check_accepting(self) -> None:
        """503 while this server cannot take the request: another replica (or this one a moment
        later) can (error_response says retry on every 503)."""
        later = {"retry-after": "1"}
        if self.draining:
            raise APIError(503, SHUTDOWN_MESSAGE, code="shutting_down", headers=later)
        if not self.ready:
            if self.load_error is not None:
                raise APIError(503, "the model failed to load", code="worker_unavailable", headers=later)
            raise APIError(503, "the model is not ready yet", code="not_ready", headers=later)
        problem = self.engine.problem(self.config.stall_timeout, self.loading)
        if not self.engine.healthy or problem is not None:
            raise APIError(
                503,
                f"the inference worker is not serving ({problem or 'not running'})",
                code="worker_unavailable",
                headers=later,
            )

    async def prepare(self, chat: ChatRequest) -> tuple[PreparedRequest, list[ChoiceHold]]:
        """Admission (429 past --max-waiting / --max-pending-preprocess) + CPU preprocessing; a
        hold on each choice's place in --max-waiting, for `generate` to hand over."""
        return await self.admission.prepare(chat)

    async def generate(self, request_id, prepared, sampling, arrival: float | None = None, hold=None):
        """Engine events for one choice, with latency metrics and one log line per request.

        Latencies count from `arrival` (perf_counter when the request came in, as in vLLM's
        metrics), so TTFT and E2E include reading the body and CPU preprocessing. `hold` (its
        ChoiceHold) is released once the engine counts the choice."""
        m = self.metrics
        start = arrival if arrival is not None else time.perf_counter()
        last = start
        ttft = None
        final = None
        streamed = 0  # tokens delivered: what a request cancelled before its final event made
        try:
            if self.closed:
                raise EngineError(SHUTDOWN_MESSAGE, code="shutting_down", status=503)
            handed = hold.release if hold is not None else None
            async for event in self.engine.generate(request_id, prepared, sampling, registered=handed):
                now = time.perf_counter()
                if event.token_ids:
                    streamed += len(event.token_ids)
                    if ttft is None:
                        ttft = now - start
                        m.ttft.observe(ttft)
                    else:
                        m.itl.observe(now - last)
                    last = now
                if event.finish_reason is not None:
                    final = event
                yield event
        finally:
            if hold is not None:  # the engine never took it (shutting down, unavailable)
                hold.release()
            self._account(request_id, prepared, final, ttft, time.perf_counter() - start, streamed)

    def _account(self, request_id, prepared, final, ttft, elapsed, streamed: int = 0) -> None:
        m = self.metrics
        if final is not None:
            m.prompt_tokens.inc(final.prompt_tokens)
            m.generation_tokens.inc(final.completion_tokens)
        elif streamed:  # cancelled after its prompt ran: the work done counts all the same
            m.prompt_tokens.inc(prepared.num_prompt_tokens)
            m.generation_tokens.inc(streamed)
        if final is not None and final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            status = final.finish_reason.value
            m.succeed(status)
            m.e2e.observe(elapsed)
        else:
            status = final.finish_reason.value if final is not None else "cancelled"
            m.fail(status)
        done = final.completion_tokens if final is not None else streamed
        image_tokens = 0
        image_token = self.engine.info.image_token_id if self.engine.info is not None else None
        if prepared.num_images and image_token is not None:
            image_tokens = int((prepared.prompt_ids == image_token).sum())
        decode_s = elapsed - ttft if ttft is not None else 0.0
        # Counts and timings only: never the prompt, image bytes/URLs or headers.
        log.info(
            "request id=%s status=%s prompt_tokens=%d cached_tokens=%d image_count=%d image_tokens=%d "
            "completion_tokens=%d ttft_ms=%s tok_per_s=%.1f e2e_ms=%.0f",
            request_id,
            status,
            prepared.num_prompt_tokens,
            final.cached_tokens if final else 0,
            prepared.num_images,
            image_tokens,
            done,
            f"{ttft * 1000:.0f}" if ttft is not None else "-",
            (done - 1) / decode_s if done > 1 and decode_s > 0 else 0.0,
            elapsed * 1000,
        )

    # ---- health ------------------------------------------------------------------------
    def liveness(self) -> tuple[bool, str | None]:
        problem = self.engine.problem(self.config.stall_timeout, self.loading)
        if problem is None and self.load_error is not None:
            problem = "model failed to load"
        return problem is None, problem

    def readiness(self) -> tuple[bool, str | None]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "load failed" if self.load_error else "loading"
        return self.liveness()

    # ---- observability hooks (metrics land here) -----------------------------------------
    def observe_preprocess(self, seconds: float) -> None:  # kept for callers timing outside prepare()
        self.metrics.preprocess.observe(seconds)

    def count_failure(self, exc: APIError) -> None:
        self.metrics.fail(exc.code or str(exc.status))
        if exc.code in ("invalid_image_url", "invalid_image"):
            self.metrics.image_fetch_failures.inc()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.engine.num_running)
        m.waiting.set(self.engine.num_waiting + self.pending_choices)
        gauges = self.engine.cache_gauges()
        if gauges.prefix_usage is not None:
            m.prefix_cache_usage.set(gauges.prefix_usage)
        if gauges.mm_prefix_usage is not None:
            m.mm_prefix_cache_usage.set(gauges.mm_prefix_usage)
        m.kv_cache_tokens.set(gauges.kv_tokens)
        m.kv_blocks_used.set(gauges.kv_blocks_used)
        m.kv_blocks_free.set(gauges.kv_blocks_total - gauges.kv_blocks_used)
        m.kv_blocks_cached.set(gauges.kv_blocks_cached)
        m.preemptions.set(gauges.preemptions)
        m.warmup_pending.set(gauges.warmup_pending)
        # The engine counts feature-cache lookups since its start; the counters take what is new.
        m.feature_queries.inc(max(0, gauges.feature_queries - self._feature_seen[0]))
        m.feature_hits.inc(max(0, gauges.feature_hits - self._feature_seen[1]))
        self._feature_seen = (gauges.feature_queries, gauges.feature_hits)
        for kind, value in gauges.memory.items():
            m.device_memory.labels(m.model_name, kind).set(value)


async def watch_event_loop(histogram, period: float = 0.05) -> None:
    """Observe how late the loop wakes a timer: what every request (and /health) waits on top."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        histogram.observe(max(0.0, time.perf_counter() - t0 - period))


def create_app(config: ServerConfig) -> Starlette:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if config.listen_while_loading:
            state.start_in_background()
        else:
            try:
                await state.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    await state.engine.stop()
                raise
        watcher = asyncio.create_task(watch_event_loop(state.metrics.loop_lag))
        watchdog = asyncio.create_task(state.watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            watchdog.cancel()
            await state.stop()

    middleware = [
        Middleware(
            BrowserGuardMiddleware,
            allowed_origins=config.cors_origins,
            loopback_only=is_loopback(config.host),
            allowed_hosts=config.allowed_hosts,
        )
    ]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["authorization", "content-type"],
            )
        )
    if config.api_key:
        middleware.append(
            Middleware(APIKeyMiddleware, api_key=config.api_key, protect_metrics=config.metrics_require_key)
        )
    middleware.append(Middleware(BodySizeMiddleware, max_bytes=config.max_body_bytes))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={404: not_found, 405: method_not_allowed},
    )
    # A path with a trailing slash is a 404 in the error shape, not a 307 to a URL built from the
    # client's Host header.
    app.router.redirect_slashes = False
    app.state.server = state
    return app


__all__ = ["create_app", "ServerState"]
