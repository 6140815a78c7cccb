"""Where a whole bench level's time goes: the scheduler's steps and each request's milestones.

    TRACE=steps.json python scripts/probe_steps.py serve MODEL --port 8100 [serve options]
    python scripts/bench.py --url http://127.0.0.1:8100 --concurrency 32 --out w1.json
    (stop the server with Ctrl-C: the trace is written on the way out)
    python scripts/probe_steps.py report steps.json w1.json

`serve` is `vlmserve serve` with the scheduler's phases wrapped; every event is kept with
perf_counter() milliseconds, the clock bench.py's timeline uses too (one host). `report` prints,
per bench level: when the load generator sent each request against when the server saw it,
when preprocessing, first tokens and ends came, and the steps over 15 ms with their parts
(waiting / prefilling / running counts, then each phase, its size, and ms). With SYNC=1 the
worker also waits for the device after each launch (lengths become device time; the pipeline
serializes). `aeval` is time inside mx.async_eval: on CUDA it waits while more than 10 of
MLX's 20-op command buffers are in flight, so it shows device time the host could not overlap.
"""

from __future__ import annotations

import json
import os
import sys
import time

_events: list[list] = []


def _now() -> float:
    return round(1000 * time.perf_counter(), 3)


def _instrument() -> None:
    import mlx.core as mx

    from vlmserve import cli
    from vlmserve.api import app, routes
    from vlmserve.engine import decode_batch, model
    from vlmserve.engine import scheduler as sched

    sync = os.environ.get("SYNC") == "1"

    def wrap(owner, attr, label, info=lambda args: 0, wait=False):
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0, size = _now(), info(args)
            try:
                return fn(*args, **kwargs)
            finally:
                _events.append([label, t0, _now(), size])
                if wait and sync:
                    t1 = _now()
                    mx.synchronize()
                    _events.append(["sync_" + label, t1, _now(), 0])

        setattr(owner, attr, timed)

    chat = routes._chat_completions

    async def arrive(request):
        _events.append(["arrive", _now()])
        return await chat(request)

    routes._chat_completions = arrive
    prepare = app.ServerState.prepare

    async def prepared(self, request):
        t0 = _now()
        try:
            return await prepare(self, request)
        finally:
            _events.append(["prep", t0, _now(), 0])

    app.ServerState.prepare = prepared
    S = sched.MLLMScheduler
    wrap(S, "step", "step", lambda a: [len(a[0].inbox) + len(a[0].waiting), len(a[0].prefilling), len(a[0].running)])
    wrap(S, "_embed_upcoming", "embed_many", lambda a: sum(1 for q in a[0].prefilling if q.prompt is None))
    wrap(S, "_embed", "embed_one", lambda a: int(a[1].prompt is None))
    wrap(S, "_prefill_group", "prefill_group", lambda a: len(a[1]))
    wrap(S, "_prefill_one", "prefill_one", lambda a: 1)
    wrap(S, "_launch", "launch", lambda a: len(a[0].running), wait=True)
    wrap(S, "_resolve", "resolve", lambda a: sum(1 for q in a[1][0] if q is not None and q.generated == 0))
    wrap(model, "_device_inputs", "h2d")
    wrap(model.VLM, "_tower", "tower_graph")
    wrap(model.VLM, "_embed_image_prompt", "embed_prompt")
    wrap(model.VLM, "prefill_batch", "prefill_graph", wait=True)
    wrap(decode_batch.SlotDecodeBatch, "join", "join")

    class TimedAsyncEval:  # the scheduler's `mx`, with async_eval timed
        def __getattr__(self, name):
            return getattr(mx, name)

        def async_eval(self, *arrays):
            t0 = _now()
            try:
                return mx.async_eval(*arrays)
            finally:
                _events.append(["aeval", t0, _now(), 0])

    sched.mx = TimedAsyncEval()
    accept, finish = S._accept, S._finish

    def accepted(self, seq, token, logprobs):
        if seq.generated == 0:
            _events.append(["first", _now()])
        return accept(self, seq, token, logprobs)

    def finished(self, seq, *args, **kwargs):
        if not seq.finished:
            _events.append(["finish", _now()])
        return finish(self, seq, *args, **kwargs)

    S._accept, S._finish = accepted, finished
    exit_now = cli._exit_now  # the server leaves by os._exit: write the trace first

    def write_then_exit(code):
        with open(os.environ.get("TRACE", "steps.json"), "w") as f:
            json.dump(_events, f)
        exit_now(code)

    cli._exit_now = write_then_exit


def report(trace_path: str, bench_path: str, min_step_ms: float = 15.0) -> None:
    events = json.load(open(trace_path))
    for level in json.load(open(bench_path))["runs"][0]["levels"]:
        t0 = 1000 * level["level_start_monotonic_s"]
        t1 = t0 + 1000 * level["wall_s"]
        inside = [e for e in events if t0 - 5 <= e[1] <= t1]

        def times(kind, end=False):
            return " ".join(f"{(e[2] if end else e[1]) - t0:.0f}" for e in sorted(inside, key=lambda e: e[1])
                            if e[0] == kind)

        print(f"== c={level['concurrency']}: {level['output_tok_s']:.0f} tok/s, {level['wall_s'] * 1000:.0f} ms "
              f"(ms from the level's first send)")
        print("  sent       ", " ".join(f"{1000 * row[0]:.0f}" for row in level["timeline"]))
        print("  arrived    ", times("arrive"))
        print("  prepared   ", times("prep", end=True))
        print("  first token", times("first"))
        print("  ended      ", times("finish"))
        parts = [e for e in inside if len(e) > 2 and e[0] != "step"]
        for step in (e for e in inside if e[0] == "step" and e[2] - e[1] >= min_step_ms):
            within = [p for p in parts if step[1] <= p[1] and p[2] <= step[2] and p[2] - p[1] >= 0.05]
            waiting, prefilling, running = step[3]
            print(f"  step {step[1] - t0:7.1f} +{step[2] - step[1]:6.1f} w{waiting} p{prefilling} r{running} | "
                  + " ".join(f"{p[0]}({p[3]}):{p[2] - p[1]:.1f}" for p in within))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        report(*sys.argv[2:4])
    else:
        _instrument()
        from vlmserve.cli import main

        sys.exit(main(sys.argv[1:]))
