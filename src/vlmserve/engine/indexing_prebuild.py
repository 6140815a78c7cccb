"""Build MLX's indexing kernels in parallel processes on a start whose kernel cache lacks them.

On CUDA, MLX compiles one module per gather (array dtype, index dtype, index count), per
take/put-along-axis (array dtype, index dtype), per scatter (its reduction too) and per masked
scatter (dtype), each holding the variants of every rank: 4-5 s of one core each on an H100
machine, at first use, on the MLX thread. A model's first requests meet several of them one
after another (embedding lookups, KV writes, sampling, image features), and a sampling
parameter that first shows up under load would stall every stream while its module compiles.

They depend on dtypes only, so while the engine loads, small processes build the likely ones
side by side, each into a directory of its own, and file each module into the kernel cache as
soon as it is built (kernel_staging.publish); the engine then reads them instead of compiling
them. A module already in the cache is not built again. Anything that goes wrong here costs
only time.

    python -m vlmserve.engine.indexing_prebuild [--file-into CACHE] gather:bfloat16:int32:1 ...
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from vlmserve.engine.kernel_prebuild import activation_dtype, settings
from vlmserve.engine.kernel_staging import SIDE_PROCESSES, StagedBuild, publish

log = logging.getLogger(__name__)

TIMEOUT_S = 240.0  # a build process past this is stopped (the engine compiles what it lacks)
FIRST_WAIT_S = 10.0  # the longest a load waits for the first modules (one takes 4-5 s of a core)
_POLL_S = 0.2
PROGRESS_S = 5.0  # at most one progress line in this time
_INDEX_DTYPES = ("int32", "uint32")  # what the models' index arrays and argsort/argmax outputs are


def first_forward(dtype: str, quantized: bool = False) -> list[str]:
    """The specs a model's first forward meets: embedding lookups (a `quantized` model's gathers
    its packed uint32 weights too), KV writes, id and position tables."""
    first = [f"gather:{dtype}:int32:1"] + (["gather:uint32:int32:1"] if quantized else [])
    return first + [f"scatter:{dtype}:int32:Assign:1", "gather:int32:int32:1", "gather:float32:int32:1"]


def likeliest(dtype: str, quantized: bool = False) -> list[str]:
    """The specs a model's first forwards and requests meet, in the order they meet them: the
    first forward's, then sampling's top-p, penalties and logprobs."""
    first = first_forward(dtype, quantized)
    first += [f"gather:{dtype}:int32:2", f"gather:{dtype}:uint32:1", "gather:int64:uint32:1"]
    return first + ["scatter:float32:uint32:Sum:1", f"scatter:{dtype}:int32:Sum:1", "gather:uint32:uint32:1"]


def modules(dtype: str, quantized: bool = False) -> list[str]:
    """The build specs for a model computing in `dtype`, the likeliest first: the arrays a server
    indexes are its activations and KV (`dtype`), float32 (logits, position tables) and integers
    (ids, positions, argsort's uint32 orders)."""
    arrays = list(dict.fromkeys((dtype, "float32", "int32", "int64", "uint32")))
    first = likeliest(dtype, quantized)
    specs = [f"gather:{a}:{i}:{n}" for a in arrays for i in _INDEX_DTYPES for n in (1, 2)]
    specs += [f"gather_axis:{a}:{i}" for a in arrays[:3] for i in _INDEX_DTYPES]
    specs += [f"scatter:{a}:{i}:{op}:1" for a in arrays[:2] for i in _INDEX_DTYPES for op in ("Assign", "Sum")]
    specs += [f"masked_scatter:{dtype}"] + [f"scatter_axis:{a}:int32" for a in arrays[:2]]
    return list(dict.fromkeys(first + specs))


def module_name(spec: str) -> str:
    """The name MLX files the spec's module under (mlx/backend/cuda/indexing.cpp)."""
    kind, *parts = spec.split(":")
    if kind == "scatter_axis":
        return f"scatter_axis_{parts[0]}_{parts[1]}_Assign"
    return "_".join([kind, *parts])


def in_cache(cache: Path, spec: str) -> bool:
    """Whether the kernel cache holds the spec's module (built by a side process or the engine)."""
    return (cache / f"{module_name(spec)}.ptx").exists()


def build(spec: str) -> None:
    """Run the spec's op on tiny arrays: MLX compiles (and caches) its module."""
    import mlx.core as mx

    kind, *parts = spec.split(":")
    a = mx.zeros((4, 3), dtype=getattr(mx, parts[0]))
    index = getattr(mx, parts[1]) if len(parts) > 1 else mx.int32
    rows = mx.array([0, 2], dtype=index)
    ones = mx.ones((2, 3), dtype=a.dtype)
    if kind == "gather":
        out = a[rows] if parts[2] == "1" else a[rows, rows]
    elif kind == "gather_axis":
        out = mx.take_along_axis(a, mx.zeros((4, 2), dtype=index), axis=1)
    elif kind == "scatter" and parts[2] == "Sum":
        out = a.at[rows].add(ones)
    elif kind == "scatter":
        a[rows] = ones
        out = a
    elif kind == "scatter_axis":
        out = mx.put_along_axis(a, mx.zeros((4, 1), dtype=index), mx.ones((4, 1), dtype=a.dtype), axis=1)
    elif kind == "masked_scatter":
        a[mx.array([True, False, True, False])] = ones
        out = a
    else:
        raise ValueError(f"unknown indexing build {spec!r}")
    mx.eval(out)


class Prebuild:
    """The build processes of one start, reaped by one thread as each ends (each files its own
    modules as it builds them); `stop` ends them."""

    def __init__(self, parts: list[list[str]], cache: Path, timeout: float = TIMEOUT_S, likely=None):
        """`likely`: the specs a load's first forward may meet (all where None), which it waits for
        while they are under way (wait_for_first)."""
        self.started = time.monotonic()
        self.cache = cache
        self.specs = [spec for part in parts for spec in part]
        self._firsts = [part[0] for part in parts]  # each process's, under way from its start
        self._likely = likely
        self._timeout = timeout
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the reaper and `stop` never act on a process at once
        self.builds: list[StagedBuild] = []
        try:
            for part in parts:
                # No seeded links: each spec is built whether or not the cache holds the others.
                self.builds.append(
                    StagedBuild(__name__, ["--file-into", str(cache), *part], cache, "indexing", seed=False)
                )
        except OSError:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._reap, name="vlmserve-indexing-prebuild", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        """Whether builds are still under way."""
        return self._thread.is_alive()

    def wait_for_first(self, timeout: float = FIRST_WAIT_S) -> float:
        """Wait (at most `timeout` s) until each process's first module, if one of the likely ones,
        is in the cache or its process has ended; returns the seconds waited. What is left of a
        build under way since the processes started takes less than compiling the module again
        on the MLX thread, which a first forward would do."""
        t0 = time.monotonic()
        likely = self._likely
        pending = [(b, s) for b, s in zip(self.builds, self._firsts) if likely is None or s in likely]
        while time.monotonic() - t0 < timeout and not self._stopping.is_set():
            pending = [(b, spec) for b, spec in pending if not in_cache(self.cache, spec) and not b.done()]
            if not pending:
                break
            time.sleep(_POLL_S / 4)
        return time.monotonic() - t0

    def built(self) -> int:
        """How many of the specs' modules the cache holds."""
        return sum(in_cache(self.cache, s) for s in self.specs)

    def _reap(self) -> None:
        pending, failed = list(self.builds), 0
        shown, shown_at = 0, time.monotonic()
        while pending and not self._stopping.is_set():
            if time.monotonic() - shown_at >= PROGRESS_S:  # a line while they run: n of N so far
                shown_at = time.monotonic()
                try:
                    built = self.built()
                except OSError:  # the cache unreadable for now: the builds are still reaped
                    built = shown
                if built > shown:
                    shown = built
                    log.info(
                        "MLX's indexing kernels: %d/%d in the kernel cache (%.0f s)",
                        built,
                        len(self.specs),
                        shown_at - self.started,
                    )
            late = time.monotonic() - self.started > self._timeout
            with self._lock:
                if self._stopping.is_set():
                    return
                for b in [b for b in pending if late or b.done()]:
                    pending.remove(b)
                    failed += not b.finish(5.0 if b.done() else 0.0)  # an ended one: its stderr read
            time.sleep(_POLL_S)
        if not self._stopping.is_set():
            log.info(
                "MLX's indexing kernels: %d of %d modules in the kernel cache after %.1f s "
                "(%d parallel processes, %d failed or stopped)",
                self.built(),
                len(self.specs),
                time.monotonic() - self.started,
                len(self.builds),
                failed,
            )

    def stop(self) -> None:
        """End the builds still running (what they filed stays filed)."""
        self._stopping.set()
        with self._lock:
            for b in self.builds:
                b.kill()


def start(model_path: Path, processes: int = SIDE_PROCESSES) -> Prebuild | None:
    """Start building the indexing modules the kernel cache lacks for this model, in up to
    `processes` processes; None: nothing to build, or no kernel cache."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache:
        return None
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype, quantized = activation_dtype(config), bool(settings(config))
    missing = [s for s in modules(dtype, quantized) if not in_cache(Path(cache), s)]
    if not missing:
        return None
    count = max(1, min(processes, len(missing)))
    try:
        parts = [missing[i::count] for i in range(count)]
        return Prebuild(parts, Path(cache), likely=set(first_forward(dtype, quantized)))
    except OSError:
        log.warning("could not start the indexing kernel builds", exc_info=True)
        return None


def main(argv: list[str] | None = None) -> int:
    """Build each spec, filing each module into the shared cache (`--file-into`) as soon as it is
    built; a spec that fails is skipped. Exits non-zero only if none was built."""
    args = list(sys.argv[1:] if argv is None else argv)
    shared = None
    if args[:1] == ["--file-into"]:
        shared, args = Path(args[1]), args[2:]
    private = os.environ.get("MLX_PTX_CACHE_DIR")
    try:
        os.nice(5)  # the engine's own compiles come first where cores run short
    except OSError:
        pass
    built = 0
    for spec in args:
        try:
            build(spec)
        except Exception as e:  # noqa: BLE001 - the engine compiles it at first use instead
            print(f"{spec}: {e}", file=sys.stderr)
            continue
        built += 1
        if shared is not None and private:
            publish(Path(private), shared)
    return 0 if built or not args else 1


if __name__ == "__main__":
    sys.exit(main())
