"""Starlette app factory and lifespan: load + warm the model, report ready, drain on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from ..config import ServerConfig
from ..engine.engine import Engine
from ..preprocess import Preprocessor
from ..protocol import ChatMessage, EngineError, FinishReason, ImageRef, SamplingParams
from .errors import APIError
from .routes import not_found, routes

log = logging.getLogger("vlmserve")


class ServerState:
    """Everything a route needs, in one object on app.state.server."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine = Engine(config)
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
        self.preprocessor = await loop.run_in_executor(
            None, Preprocessor, self.engine.model_path, self.engine.info.context_length, self.config
        )
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
        async for event in self.engine.generate(request_id, prepared, sampling):
            yield event

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
        pass

    def count_failure(self, exc: APIError) -> None:
        pass


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

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
    app.state.server = state
    return app


__all__ = ["create_app", "ServerState", "EngineError", "HTTPException"]
