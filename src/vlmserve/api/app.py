"""Starlette app factory and lifespan: load + warm the model, report ready, drain on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from PIL import Image
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from ..config import ServerConfig
from ..engine.engine import Engine
from ..engine.processor import load_processor
from ..metrics import Metrics, SchedulerHooks
from ..preprocess import Preprocessor
from ..protocol import ChatMessage, FinishReason, ImageRef, SamplingParams
from .auth import APIKeyMiddleware
from .errors import APIError
from .routes import method_not_allowed, not_found, routes

log = logging.getLogger("vlmserve")


class ServerState:
    """Everything a route needs, in one object on app.state.server."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics(config.model_id)
        self.engine = Engine(config, hooks=SchedulerHooks(self.metrics))
        self.preprocessor: Preprocessor | None = None
        self.ready = False
        self.draining = False
        self.created = int(time.time())

    # ---- identity ----------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def model_names(self) -> set[str]:
        return {self.config.model_id}

    @property
    def context_length(self) -> int:
        return self.engine.info.context_length

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.perf_counter()
        await self.engine.start()
        loop = asyncio.get_running_loop()
        processor = await loop.run_in_executor(None, load_processor, self.engine.model_path)
        self.preprocessor = Preprocessor(processor, self.engine.info.context_length, self.config)
        if self.config.warmup:
            await self.warmup()
        self.ready = True
        log.info("ready: %s (%s) in %.2f s", self.model_id, self.engine.info.model_type, time.perf_counter() - t0)

    async def warmup(self) -> None:
        """One text and one image generation, so the first real request pays no first-call costs."""
        loop = asyncio.get_running_loop()
        image = Image.new("RGB", (64, 64), (127, 127, 127))
        for parts, images in (([("text", "Hello")], []), ([("image", ImageRef("warmup", "warmup")), ("text", "Hi")], [image])):
            prompt = self.preprocessor.render([ChatMessage("user", parts)])
            prepared = await loop.run_in_executor(self.preprocessor.pool, self.preprocessor.encode, prompt, images)
            async for event in self.engine.generate("warmup", prepared, SamplingParams(max_tokens=2, temperature=0)):
                if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    raise RuntimeError(f"warm-up generation failed: {event.error}")

    async def stop(self) -> None:
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + self.config.drain_timeout
        while self.engine.num_running + self.engine.num_waiting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.engine.stop()
        if self.preprocessor is not None:
            self.preprocessor.close()

    # ---- admission -------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not self.ready:
            raise APIError(503, "the model is not ready yet", code="not_ready", headers={"retry-after": "1"})
        if not self.engine.healthy:
            raise APIError(503, "the inference worker is not running", code="worker_unavailable")

    def check_capacity(self, n: int) -> None:
        if self.engine.num_waiting + n > self.config.max_waiting:
            raise APIError(429, "too many requests are waiting; retry later", code="queue_full",
                           headers={"retry-after": "1"})

    async def generate(self, request_id, prepared, sampling):
        """Engine events for one choice, with latency metrics and one log line per request."""
        m = self.metrics
        start = last = time.perf_counter()
        ttft = None
        status = "incomplete"
        final = None
        try:
            async for event in self.engine.generate(request_id, prepared, sampling):
                now = time.perf_counter()
                if event.token_ids:
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
            elapsed = time.perf_counter() - start
            if final is not None and final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                status = final.finish_reason.value
                m.succeed(status)
                m.e2e.observe(elapsed)
                m.prompt_tokens.inc(final.prompt_tokens)
                m.generation_tokens.inc(final.completion_tokens)
            else:
                status = final.finish_reason.value if final is not None else "cancelled"
                m.fail(status)
            done = final.completion_tokens if final is not None else 0
            log.info(
                "request id=%s status=%s prompt_tokens=%d cached_tokens=%d image_count=%d completion_tokens=%d "
                "ttft_ms=%s tok_per_s=%.1f e2e_ms=%.0f",
                request_id, status, prepared.num_prompt_tokens, final.cached_tokens if final else 0,
                prepared.num_images, done, f"{ttft * 1000:.0f}" if ttft is not None else "-",
                done / elapsed if elapsed > 0 else 0.0, elapsed * 1000,
            )

    # ---- health ------------------------------------------------------------------------
    def liveness(self) -> tuple[bool, str | None]:
        worker = self.engine.worker
        if worker.error is not None or (worker.ident is not None and not worker.is_alive()):
            return False, "inference worker died"
        if worker.ident is not None and time.monotonic() - worker.heartbeat > self.config.stall_timeout:
            return False, "inference worker stalled"
        return True, None

    def readiness(self) -> tuple[bool, str | None]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "loading"
        ok, reason = self.liveness()
        return ok, reason

    # ---- observability hooks (metrics land here) -----------------------------------------
    def observe_preprocess(self, seconds: float) -> None:
        self.metrics.preprocess.observe(seconds)

    def count_failure(self, exc: APIError) -> None:
        self.metrics.fail(exc.code or str(exc.status))
        if exc.code in ("invalid_image_url", "invalid_image"):
            self.metrics.image_fetch_failures.inc()

    def refresh_gauges(self) -> None:
        m, sched = self.metrics, self.engine.scheduler
        m.running.set(self.engine.num_running)
        m.waiting.set(self.engine.num_waiting)
        if sched is not None and sched.prefix_cache is not None:
            pc = sched.prefix_cache
            m.prefix_cache_usage.set(pc.size_tokens / max(1, pc.max_tokens))
        if sched is not None:
            m.kv_cache_tokens.set(sum(s.cache_len for s in list(sched.running)))


def create_app(config: ServerConfig) -> Starlette:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        try:
            await state.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await state.engine.stop()
            raise
        try:
            yield
        finally:
            await state.stop()

    middleware = []
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type"]))
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key,
                                     protect_metrics=config.metrics_require_key))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: not_found, 405: method_not_allowed})
    app.state.server = state
    return app


__all__ = ["create_app", "ServerState"]
