"""`vlmserve serve` that prints, for each request, a timeline of where its time to first token went.

    python scripts/probe_ttft.py serve MODEL --port 8100 [serve options]
    python scripts/bench.py --url http://127.0.0.1:8100 --concurrency 1 --requests-per-level 6

Meant for one request at a time (c=1): the phases of the HTTP route, CPU preprocessing and
the scheduler's steps are timed by wrapping them, and when a request's first content chunk
is rendered, every phase since its arrival is printed to stderr (start and length in ms,
thread). With PROBE_SYNC=1 the worker also waits for the device after the vision tower, each
prefill and each decode launch, so the printed lengths are device time, not launch time
(that serializes the pipeline: use it to split TTFT, not to measure it).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time

_events: list[tuple[float, float, str, str]] = []  # (start, end, thread, phase)
_arrival: list[float] = []
_SYNC = os.environ.get("PROBE_SYNC") == "1"


def _record(t0: float, name: str) -> None:
    _events.append((t0, time.perf_counter(), threading.current_thread().name, name))


def _wrap(owner, attr: str, name: str | None = None, sync: bool = False) -> None:
    fn = getattr(owner, attr)
    name = name or attr
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _record(t0, name)
    else:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if sync and _SYNC:
                    import mlx.core as mx

                    mx.synchronize()
                return out
            finally:
                _record(t0, name)
    setattr(owner, attr, timed)


def _instrument() -> None:
    from vlmserve import preprocess, preprocess_processes
    from vlmserve.api import app, routes, sse
    from vlmserve.api import openai as oai
    from vlmserve.engine import engine, model, scheduler

    chat = routes._chat_completions

    async def arrive(request):
        _events.clear()
        _arrival[:] = [time.perf_counter()]
        return await chat(request)

    routes._chat_completions = arrive
    _wrap(routes, "_read_json")
    _wrap(oai, "parse_chat_request")
    _wrap(app.ServerState, "prepare")
    _wrap(preprocess.Preprocessor, "fetch_images")
    _wrap(preprocess.Preprocessor, "encode_chat")
    _wrap(preprocess_processes.PreprocessProcesses, "prepare", "process prepare")
    _wrap(scheduler.MLLMScheduler, "add")
    for phase in ("_admit", "_embed_upcoming", "_prefill_group", "_join", "_resolve"):
        _wrap(scheduler.MLLMScheduler, phase)
    _wrap(scheduler.MLLMScheduler, "_launch", sync=True)
    _wrap(scheduler.MLLMScheduler, "step", "  step")
    _wrap(model.VLM, "embed_prompts", sync=True)
    _wrap(model.VLM, "prefill", sync=True)
    _wrap(model.VLM, "prefill_batch", sync=True)
    _wrap(engine, "_deliver")
    _wrap(scheduler.MLLMScheduler, "release_idle_memory")
    content = sse.ChunkLines.content

    def first_content(self, index, text):
        if _arrival:
            _report(_arrival.pop())
        return content(self, index, text)

    sse.ChunkLines.content = first_content


def _report(arrival: float) -> None:
    now = time.perf_counter()
    lines = [f"TTFT {1000 * (now - arrival):.1f} ms (server, arrival to first content chunk)"]
    for t0, t1, thread, name in sorted(e for e in _events if e[0] >= arrival):
        lines.append(f"  {1000 * (t0 - arrival):7.1f} +{1000 * (t1 - t0):6.1f} ms  {name:<18} {thread}")
    print("\n".join(lines), file=sys.stderr, flush=True)


if __name__ == "__main__":
    _instrument()
    from vlmserve.cli import main

    sys.exit(main(sys.argv[1:]))
