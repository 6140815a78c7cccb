"""The messages between the serving process and the engine process, one dataclass each.

They cross a multiprocessing pipe by pickle. No MLX here: both processes import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.protocol import CacheGauges, ModelInfo, PreparedRequest, SamplingParams, TokenEvent

# ---- serving process -> engine process ---------------------------------------------------


@dataclass
class AddRequest:
    key: int  # the serving side's handle for this request's events
    request_id: str
    sampling: SamplingParams
    inputs_key: int  # names the prepared inputs; several choices of one request share them
    prepared: PreparedRequest | None  # sent with the first request naming inputs_key, None after
    pixels_held: bool = False  # its pixel arrays were left out: the engine holds them (held_pixels.py)


@dataclass
class ReleaseInputs:
    """No request will name `inputs_key` again: the engine may drop those inputs."""

    inputs_key: int


@dataclass
class CancelRequest:
    key: int


@dataclass
class Call:
    """Run one of the engine's jobs (process_main.CALLS) on its worker and answer with CallResult."""

    call_id: int
    name: str
    args: tuple


@dataclass
class Stop:
    pass


# ---- engine process -> serving process ---------------------------------------------------


@dataclass
class Ready:
    info: ModelInfo
    model_path: str
    gauges: CacheGauges | None = None  # as the load left them (the KV budget's blocks): /metrics before any step


@dataclass
class LoadFailed:
    reason: str


@dataclass
class EngineStats:
    """What the serving side's admission, gauges and health need, sent with every StepOutput."""

    running: int = 0
    gauges: CacheGauges = field(default_factory=CacheGauges)
    died: bool = False
    violations: list = field(default_factory=list)  # MLX calls off the worker (thread guard on)
    guard_calls: int | None = None  # MLX calls the thread guard has checked (thread guard on)


@dataclass
class StepOutput:
    """One engine step's events, metric samples (hook name, args) and counts."""

    events: list[tuple[int, TokenEvent]]
    hook_records: list[tuple[str, tuple]]
    stats: EngineStats


@dataclass
class CallResult:
    call_id: int
    error: str | None
    value: Any = None
