"""Build MLX's quantized-matmul kernels in parallel processes while the engine loads and serves.

On CUDA, MLX compiles its quantized matmul at first use, one kernel per activation dtype,
bits, group size, mode and row class (its tiles take 16, 32 or 64 rows; fewer than 8 rows take
a matrix-vector kernel compiled into MLX), at about 30 s each with an empty kernel cache. Each
build depends on nothing but those settings, so small processes build them side by side, each
on tiny arrays, each into a directory of its own that is then filed into the kernel cache the
engine reads (kernel_staging.py). A marker per kernel in that (MLX-versioned) cache skips the
ones a previous run built.

The engine does not wait for builds of the settings whose layers many_row_dequantized.py
serves: until a setting's builds are done, those layers run on their dequantized weight
(`hold`), and the worker takes the kernels in between steps (`Background`). It waits for the
others before its warm-up. Anything that goes wrong here costs only time.

    python -m vlmserve.engine.kernel_prebuild --bits 4 --group-size 64 --mode affine --dtype bfloat16 --rows 16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlmserve.engine.kernel_staging import StagedBuild, finish_all, remove_stale

log = logging.getLogger(__name__)

ROW_CLASSES = (16, 32, 64)  # each tile height of the matmul kernel
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def settings(config: dict) -> list[tuple[int, int, str]]:
    """(bits, group size, mode) of every quantized layer setting a model's config names: the
    model-wide one and any per-layer override (mlx-community configs)."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    found = set()

    def add(entry: dict) -> None:
        if isinstance(entry.get("bits"), int) and isinstance(entry.get("group_size"), int):
            found.add((entry["bits"], entry["group_size"], str(entry.get("mode", "affine"))))

    add(quant)
    for value in quant.values():
        if isinstance(value, dict):
            add(value)
    return sorted(found)


def activation_dtype(config: dict) -> str:
    """The dtype the model computes in (what its activations reach the matmul as)."""
    text = config.get("text_config") or {}
    for source in (config, text):
        for key in ("torch_dtype", "dtype"):
            if source.get(key) in _DTYPES:
                return _DTYPES[source[key]]
    return "bfloat16"


def _marker(cache_dir: Path, dtype: str, bits: int, group: int, mode: str, rows: int) -> Path:
    return cache_dir / "vlmserve-prebuilt" / f"qmm-{dtype}-{mode}-b{bits}-g{group}-m{rows}"


@dataclass
class KernelBuild:
    """One build process: the kernel of (bits, group size, mode) at `rows` for `dtype` activations."""

    bits: int
    group: int
    mode: str
    dtype: str
    rows: int
    staged: StagedBuild

    @property
    def setting(self) -> tuple[int, int]:
        return self.bits, self.group

    def finish(self, timeout: float) -> bool:
        return self.staged.finish(timeout)

    def kill(self) -> None:
        self.staged.kill()


def start(model_path: Path, background: tuple[str, ...] = ()) -> list[KernelBuild]:
    """Start a build process per kernel this model's config calls for and no earlier run built;
    returns them (an empty list: nothing to build, or not possible here). The builds of the
    `background` modes, which the engine serves without meanwhile, yield the CPU to the rest."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache:
        return []
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return []
    remove_stale(Path(cache))
    dtype, builds = activation_dtype(config), []
    for bits, group, mode in settings(config):
        for rows in ROW_CLASSES:
            if _marker(Path(cache), dtype, bits, group, mode, rows).exists():
                continue
            args = ["--bits", str(bits), "--group-size", str(group), "--mode", mode, "--dtype", dtype]
            args += ["--background"] if mode in background else []
            try:
                staged = StagedBuild(__name__, [*args, "--rows", str(rows)], Path(cache), "qmm")
            except OSError:
                log.warning("could not start a kernel build process", exc_info=True)
            else:
                builds.append(KernelBuild(bits, group, mode, dtype, rows, staged))
    return builds


def wait(builds: list[KernelBuild], timeout: float) -> None:
    """Wait for the build processes (at most `timeout` s in all; stragglers are stopped) and log the outcome."""
    if not builds:
        return
    failed, waited = finish_all(builds, timeout)
    log.info(
        "quantized matmul kernels: %d built in parallel processes (%d failed), waited %.1f s",
        len(builds) - failed,
        failed,
        waited,
    )


class Background:
    """Builds the engine does not wait for. Their settings' layers run dequantized meanwhile
    (many_row_dequantized.hold, done by the caller); once every build of a setting has exited,
    the worker files its kernels, loads each (a tiny matmul reads it from the cache) and lets
    the quantized matmul serve again. A setting whose build failed or ran past `timeout` stays
    dequantized: its kernels are never compiled on the request path."""

    def __init__(self, builds: list[KernelBuild], timeout: float):
        self.timeout = timeout
        self._by_setting: dict[tuple[int, int], list[KernelBuild]] = {}
        for b in builds:
            self._by_setting.setdefault(b.setting, []).append(b)
        self._builds, self._ended = list(builds), 0

    def _note_progress(self) -> None:
        """A line each time more builds have ended: n of N, while the rest run."""
        ended = sum(b.staged.done() for b in self._builds)
        if ended > self._ended:
            self._ended = ended
            since = max(time.monotonic() - b.staged.started for b in self._builds)
            log.info("quantized matmul kernels: %d/%d builds ended (%.0f s)", ended, len(self._builds), since)

    def pending(self) -> int:
        """Settings not taken yet."""
        return len(self._by_setting)

    def _due(self, builds: list[KernelBuild]) -> bool:
        return all(b.staged.done() or time.monotonic() - b.staged.started > self.timeout for b in builds)

    def ready(self) -> bool:
        """Whether a setting's builds are all over (`take_one` has work)."""
        self._note_progress()
        return any(self._due(builds) for builds in self._by_setting.values())

    def take_one(self) -> tuple[tuple[int, int], str] | None:
        """On the MLX thread: file and load one finished setting's kernels; returns the setting
        and the activation dtype they were built for if they now serve, None if it stays
        dequantized (or none was finished)."""
        setting = next((s for s, builds in self._by_setting.items() if self._due(builds)), None)
        if setting is None:
            return None
        builds = self._by_setting.pop(setting)
        since = max(time.monotonic() - b.staged.started for b in builds)
        # Ended ones only have their output read; one past the timeout is stopped.
        failed = sum(not b.finish(10.0 if b.staged.done() else 0.0) for b in builds)
        if failed:
            from vlmserve.engine.ops.many_row_dequantized import QMM_MIN_ROWS

            log.warning(
                "quantized matmul kernels for %d-bit, group %d: %d of %d builds failed or timed out; "
                "those layers keep running dequantized over %d rows or more",
                *setting,
                failed,
                len(builds),
                QMM_MIN_ROWS,
            )
            return None
        t0 = time.perf_counter()
        for b in builds:
            build(b.bits, b.group, b.mode, b.dtype, b.rows)
        log.info(
            "quantized matmul kernels for %d-bit, group %d: %d built in parallel processes, taken %.1f s "
            "after they started, loaded in %.2f s; they serve from now on",
            *setting,
            len(builds),
            since,
            time.perf_counter() - t0,
        )
        return setting, builds[0].dtype

    def stop(self) -> None:
        for builds in self._by_setting.values():
            for b in builds:
                b.kill()
        self._by_setting.clear()


def build(bits: int, group: int, mode: str, dtype: str, rows: int) -> None:
    """Run one quantized matmul of these settings on tiny arrays: MLX builds (and caches) its kernel."""
    import mlx.core as mx

    k = max(512, 8 * group)  # whole groups, and at least one tile of the kernel's K
    # Keys of its own: the engine runs this too (to load the kernel), and keeps MLX's global stream.
    w = mx.random.normal((256, k), key=mx.random.key(0)).astype(getattr(mx, dtype))
    parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    x = mx.random.normal((rows, k), key=mx.random.key(1)).astype(getattr(mx, dtype))
    biases = parts[2] if len(parts) > 2 else None
    mx.eval(mx.quantized_matmul(x, parts[0], parts[1], biases, transpose=True, group_size=group, bits=bits, mode=mode))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--mode", default="affine")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--background", action="store_true", help="yield the CPU to the start's other work")
    args = p.parse_args(argv)
    if args.background:
        try:  # what a first start waits for (the engine, the indexing kernels, vlmserve's kernels) comes first
            os.nice(10)
        except OSError:
            pass
    build(args.bits, args.group_size, args.mode, args.dtype, args.rows)
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if cache:
        marker = _marker(Path(cache), args.dtype, args.bits, args.group_size, args.mode, args.rows)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
