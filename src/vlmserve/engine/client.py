"""The one interface the serving side has to an engine, in this process or in its own.

`create_engine_client` picks the implementation; the serving side imports nothing else of
the engine, so beside an engine process it never loads the model, scheduler or MLX worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from vlmserve.config import ServerConfig
from vlmserve.protocol import CacheGauges, ModelInfo, PreparedRequest, SamplingParams, TokenEvent


class EngineClient(Protocol):
    """What the HTTP layer may ask of an engine. `info` and `model_path` are set by `start`."""

    info: ModelInfo | None
    model_path: Path | None

    async def start(self) -> None:
        """Resolve and load the model; raises with the reason if that fails."""

    async def warm_up(self, image_requests: list[PreparedRequest]) -> None:
        """Build every shape traffic will use before the server reports ready: a text prompt,
        `image_requests` (prepared through the same path as a client's), each prompt-length
        bucket, the vision tower's batch sizes and the compiled decode shapes."""

    def generate(
        self,
        request_id: str,
        prepared: PreparedRequest,
        sampling: SamplingParams,
        registered: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream one request's events; leaving the iterator early cancels the request. Several
        choices of one request pass the same `prepared`: its arrays cross to the engine once.
        `registered` is called once `num_waiting` counts the request (admission's hand-over)."""

    async def fail_all(self, message: str) -> None:
        """End every admitted request with an error event (shutdown, drain timeout)."""

    def abandon(self, message: str) -> int:
        """End every request this side waits on with a retryable error at once, without asking
        the engine (hung or gone); returns how many. Events the engine sends for them later are
        dropped."""

    async def stop(self) -> None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def problem(self, stall_timeout: float, loading: bool) -> str | None:
        """Why the engine cannot serve (None: it can)."""

    def cache_gauges(self) -> CacheGauges:
        """The prefix cache's and KV blocks' figures."""


def create_engine_client(config: ServerConfig, hooks=None) -> EngineClient:
    """The engine in a spawned process (`config.engine_process`) or on a thread of this one."""
    if config.engine_process:
        from vlmserve.engine.process_client import EngineProcessClient

        return EngineProcessClient(config, hooks)
    from vlmserve.engine.inprocess import Engine  # loads MLX: only for one-process serving

    return Engine(config, hooks=hooks)
