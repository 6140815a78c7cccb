"""Build MLX's quantized-matmul kernels in parallel processes while the engine loads.

On CUDA, MLX compiles its quantized matmul at first use, one kernel per activation dtype,
bits, group size, mode and row class (its tiles take 16, 32 or 64 rows; fewer than 8 rows take
another kernel), at about 30 s each with an empty kernel cache. Warm-up needs every class, so
built one after another on the engine's thread they made up most of a first start. Each build
depends on nothing but those settings, so small processes build them side by side, each on
tiny arrays, each into a directory of its own that is then filed into the kernel cache the
engine reads (kernel_staging.py); the engine waits for them before its warm-up. A marker per
kernel in that (MLX-versioned) cache skips the ones a previous run built. Anything that goes
wrong here costs only time: the engine builds what is missing itself.

    python -m vlmserve.engine.kernel_prebuild --bits 4 --group-size 64 --mode affine --dtype bfloat16 --rows 16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from vlmserve.engine.kernel_staging import StagedBuild, finish_all

log = logging.getLogger(__name__)

ROW_CLASSES = (1, 16, 32, 64)  # one row (decode), then each tile height of the matmul kernel
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


def start(model_path: Path) -> list[StagedBuild]:
    """Start a build process per kernel this model's config calls for and no earlier run built;
    returns them (an empty list: nothing to build, or not possible here)."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache:
        return []
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return []
    dtype, builds = activation_dtype(config), []
    for bits, group, mode in settings(config):
        for rows in ROW_CLASSES:
            if _marker(Path(cache), dtype, bits, group, mode, rows).exists():
                continue
            args = ["--bits", str(bits), "--group-size", str(group), "--mode", mode, "--dtype", dtype]
            try:
                builds.append(StagedBuild(__name__, [*args, "--rows", str(rows)], Path(cache), "qmm"))
            except OSError:
                log.warning("could not start a kernel build process", exc_info=True)
    return builds


def wait(builds: list[StagedBuild], timeout: float) -> None:
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


def build(bits: int, group: int, mode: str, dtype: str, rows: int) -> None:
    """Run one quantized matmul of these settings on tiny arrays: MLX builds (and caches) its kernel."""
    import mlx.core as mx

    k = max(512, 8 * group)  # whole groups, and at least one tile of the kernel's K
    w = mx.random.normal((256, k)).astype(getattr(mx, dtype))
    parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    x = mx.random.normal((rows, k)).astype(getattr(mx, dtype))
    biases = parts[2] if len(parts) > 2 else None
    mx.eval(mx.quantized_matmul(x, parts[0], parts[1], biases, transpose=True, group_size=group, bits=bits, mode=mode))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--mode", default="affine")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--rows", type=int, required=True)
    args = p.parse_args(argv)
    build(args.bits, args.group_size, args.mode, args.dtype, args.rows)
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if cache:
        marker = _marker(Path(cache), args.dtype, args.bits, args.group_size, args.mode, args.rows)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
