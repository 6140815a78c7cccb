"""`vlmserve serve` with a watchdog that prints the event loop's stack while the loop stalls.

    python scripts/probe_loop_stalls.py serve MODEL --port 8100 [serve options]

A loop callback beats every 2 ms; a watchdog thread samples the loop thread's stack every
1 ms while the beat is more than 12 ms late. For each stall over 15 ms it prints to stderr
the loop's most frequent stacks and, once, what the other busy threads were doing, and any
garbage collection over 2 ms since the last report (CPython's collector holds the GIL). The
watchdog takes the GIL to sample, so a starved loop shows where it was waiting for it.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import threading
import time

import uvicorn


def _stack(frame, depth: int = 7) -> str:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{code.co_name}@{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)


_collections: list[tuple[int, float]] = []  # (generation, seconds) of collections over 2 ms
_gc_start = [0.0]


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    elif time.perf_counter() - _gc_start[0] > 0.002:
        _collections.append((info["generation"], time.perf_counter() - _gc_start[0]))


def _report(duration: float, loop_stacks: collections.Counter, others: dict) -> None:
    print(f"STALL {duration * 1000:.0f} ms", file=sys.stderr)
    if _collections:
        print("   gc since the last report: " + ", ".join(f"gen{g} {s * 1000:.0f} ms" for g, s in _collections),
              file=sys.stderr)
        _collections.clear()
    for stack, n in loop_stacks.most_common(6):
        print(f"   loop x{n}: {stack}", file=sys.stderr)
    for name, stack in others.items():
        if "wait@threading" not in stack and "_worker@thread" not in stack:  # idle pool threads
            print(f"   [{name}] {stack}", file=sys.stderr)
    sys.stderr.flush()


def watch(loop: asyncio.AbstractEventLoop, loop_thread: int) -> None:
    beat = {"t": time.perf_counter()}

    def tick() -> None:
        beat["t"] = time.perf_counter()
        loop.call_later(0.002, tick)

    loop.call_soon_threadsafe(tick)
    since, loop_stacks, others = None, collections.Counter(), {}
    me = threading.get_ident()
    while True:
        time.sleep(0.001)
        now = time.perf_counter()
        lag = now - beat["t"]
        if lag > 0.012:
            frames = sys._current_frames()
            if since is None:
                since, loop_stacks = now - lag, collections.Counter()
                names = {t.ident: t.name for t in threading.enumerate()}
                others = {names.get(k, k): _stack(f, 4) for k, f in frames.items() if k not in (loop_thread, me)}
            loop_stacks[_stack(frames.get(loop_thread))] += 1
        elif since is not None and lag < 0.004:
            if now - since > 0.015:
                _report(now - since, loop_stacks, others)
            since = None


_startup = uvicorn.Server.startup


async def _startup_with_watchdog(self, sockets=None):
    threading.Thread(target=watch, args=(asyncio.get_running_loop(), threading.get_ident()),
                     daemon=True, name="loop-watchdog").start()
    return await _startup(self, sockets)


if __name__ == "__main__":
    gc.callbacks.append(_time_gc)
    uvicorn.Server.startup = _startup_with_watchdog
    from vlmserve.cli import main

    sys.exit(main(sys.argv[1:]))
