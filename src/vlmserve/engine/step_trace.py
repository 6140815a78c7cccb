"""An opt-in timing trace of engine steps, for profiling: with VLMSERVE_STEP_TRACE=FILE each
step appends one JSON line to FILE with what it did (requests embedded, images, prefill
forwards and tokens, rows decoded) and how long each phase took, device time included.

Each phase ends with `mx.synchronize()`, so the device's work is charged to the phase that
queued it. That serializes what the engine overlaps (host work of the next step with the
device's work of this one): a traced server is slower, and its trace is a profile, never a
benchmark figure.
"""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx

ENV = "VLMSERVE_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life, a line at a time
        self._started = self._last = 0.0
        self._phases: dict[str, float] = {}

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def start(self) -> None:
        mx.synchronize()  # what earlier steps queued is not this step's
        self._started = self._last = time.perf_counter()
        self._phases = {}

    def mark(self, phase: str) -> None:
        """The phase that ends now: its time, with the device's work it queued, and the host's
        share of it (`_queued_ms`, until the phase returned: the device idles through what of it
        comes before the phase's first evaluation is queued)."""
        queued = time.perf_counter()
        mx.synchronize()
        now = time.perf_counter()
        self._phases[f"{phase}_ms"] = round((now - self._last) * 1e3, 3)
        self._phases[f"{phase}_queued_ms"] = round((queued - self._last) * 1e3, 3)
        self._last = now

    def end(self, **facts) -> None:
        total = round((time.perf_counter() - self._started) * 1e3, 3)
        self._file.write(json.dumps({"time": time.time(), "step_ms": total, **self._phases, **facts}) + "\n")
