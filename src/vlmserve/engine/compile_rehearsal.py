"""On a first start, serve uncompiled while a side process compiles MLX's fused kernels.

On CUDA, every `mx.compile`d graph (the decode step, the models' activations) runs fused
kernels that MLX compiles with NVRTC at their first run, 4-9 s each, one after another on
the MLX thread. Their names come from the graphs, which only the model's own code makes, so
they cannot be listed ahead the way indexing_prebuild lists MLX's indexing kernels. A model's
first start on a machine would spend most of a minute of its warm-up on them.

So on a start whose kernel cache has never held this model's fused kernels (no marker for its
config, serving options, kernel switches, GPU and versions), the engine turns MLX's compile off
and warms up and serves uncompiled: every op then runs a kernel MLX ships built (0.5-0.7x the
compiled throughput of a 2B model at 32 streams on an H100). Meanwhile a second process loads
the same model with compile on and runs the same warm-up, which compiles the fused kernels into
a kernel cache of its own (kernel_staging.py). When it exits they move into the shared cache,
and the engine turns compile on between two steps: its graphs then load those kernels instead
of compiling them. The marker makes later starts compile from the first step. A rehearsal that
fails leaves a marker too: the next start compiles during its warm-up, as without one.

The second process holds a second copy of the weights for its minute, so a model only gets
one when two copies fit comfortably in the device's memory, and the engine's KV budget lends
it what it holds until it ends.

    python -m vlmserve.engine.compile_rehearsal JOB_DIR
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx

from vlmserve.config import ServerConfig
from vlmserve.engine.kernel_staging import StagedBuild, link_missing, make_private
from vlmserve.engine.memory import device_memory_bytes
from vlmserve.kernel_cache import package_version

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a rehearsal past this is stopped (the engine then stays uncompiled until restarted)
# Rehearse only models whose weights take at most this share of the device's memory: its copy,
# with its warm-up's working memory, then stays within what --gpu-memory-utilization and the
# engine's reserve leave (memory.py) while the engine's KV blocks grow.
WEIGHTS_SHARE = 0.15
_JOB_WAIT_S = 900.0  # the side process waits this long for the engine's warm-up prompts
HAND_OVER_WAIT_S = 30.0  # the longest the prompts wait for the kernel builds being filed
# What the side process holds beside its weights and KV pool: its steps' working memory (1-2
# GiB), MLX's buffer cache (bounded below) and its CUDA context.
WORKING_BYTES = 3 << 30
_SIDE_BUFFER_CACHE_GB = 0.5
_WATCH_S = 1.0  # the side process checks this often that the engine is still there
# Switches that change which kernels, and so which fused graphs, a model runs.
_KERNEL_SWITCHES = ("VLMSERVE_CUDA_KERNELS", "VLMSERVE_FEW_ROW_MATMUL", "MLX_CUDA_USE_CUDNN_SDPA")
# The serving options that shape the compiled graphs (a marker holds for these only).
_GRAPH_OPTIONS = (
    "max_num_seqs",
    "prefill_chunk",
    "prefill_token_budget",
    "prefill_bucket",
    "max_model_len",
    "kv_block_size",
    "compile_decode",
    "mm_cache",
    "max_pixels",
    "warmup_image_sizes",
)


def key(model_path: Path, config: ServerConfig) -> str:
    """What names this model's fused kernels: its config, the serving options that shape its
    graphs, the kernel switches, the GPU, and the versions of vlmserve, MLX and the model code."""
    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    options = {name: getattr(config, name) for name in _GRAPH_OPTIONS}
    switches = {name: os.environ.get(name) for name in _KERNEL_SWITCHES}
    info = mx.device_info()
    gpu = [info.get("device_name"), info.get("compute_capability_major"), info.get("compute_capability_minor")]
    versions = [package_version(p) for p in ("vlmserve", "mlx-vlm", "mlx-lm")] + [mx.__version__]
    h.update(json.dumps([options, switches, gpu, versions], sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def marker(cache: Path, model_path: Path, config: ServerConfig) -> Path:
    return cache / "vlmserve-prebuilt" / f"compiled-{key(model_path, config)}"


def _weights_bytes(model_path: Path) -> int:
    return sum(p.stat().st_size for p in model_path.glob("*.safetensors"))


class Rehearsal:
    """The side process of one start: it loads the model while the engine does, waits for the
    warm-up prompts (`hand_over`), warms up compiled, and exits; `finish` then files its kernels."""

    module = __name__  # what the side process runs (`python -m`)

    def __init__(
        self, model_path: Path, model_type: str, config: ServerConfig, cache: Path, done: Path, held, weights: int
    ):
        self.cache = cache
        self.marker = done  # written when it ends (compile_rehearsal.marker)
        self.weights = weights  # bytes of the copy it loads
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.interrupted = False  # `finish` found it ended by a signal (no marker left)
        self.job = make_private(cache, "rehearsal-job", seed=False)  # its config and prompts
        rehearsal_config = ServerConfig(
            **{
                **asdict(config),
                "engine_process": False,
                "thread_guard": False,
                "mlx_cache_limit_gb": _SIDE_BUFFER_CACHE_GB,
            }
        )
        with open(self.job / "config.pkl", "wb") as f:
            pickle.dump((rehearsal_config, str(model_path), model_type, sorted(held), os.getpid()), f)
        try:
            self.build = StagedBuild(self.module, [str(self.job)], cache, "rehearsal")
        except OSError:
            shutil.rmtree(self.job, ignore_errors=True)
            raise

    def hand_over(self, prompts, wait_for: Callable[[], bool] | None = None) -> None:
        """Give the side process the engine's warm-up prompts once `wait_for()` holds (at most
        HAND_OVER_WAIT_S later; from a thread of its own, so the engine's warm-up goes on), with
        what the kernel cache holds by then: the kernels side processes built meanwhile, which
        it then need not build (vlmserve's take a second each)."""
        prompts = list(prompts)

        def give() -> None:
            deadline = time.monotonic() + HAND_OVER_WAIT_S
            while wait_for is not None and not wait_for() and time.monotonic() < deadline:
                time.sleep(0.1)
            with self._lock:  # never while `finish` or `stop` removes its directories
                if not self.job.is_dir():
                    return  # ended meanwhile
                try:
                    link_missing(self.cache, self.build.private, copy=True)
                    tmp = self.job / "prompts.tmp"
                    with open(tmp, "wb") as f:
                        pickle.dump(prompts, f)
                    os.replace(tmp, self.job / "prompts.pkl")
                except OSError:  # a full disk: the side process waits, then fails
                    log.warning("could not hand the warm-up prompts to the compile rehearsal", exc_info=True)

        threading.Thread(target=give, name="vlmserve-compile-rehearsal", daemon=True).start()

    def done(self) -> bool:
        """Whether the side process has ended, or run out of time (`finish` then returns at once)."""
        return self.build.done() or time.monotonic() - self.started > TIMEOUT_S

    def finish(self) -> bool:
        """File what it compiled and leave the marker (a failure's too); True: compile may go on."""
        with self._lock:
            ok = self.build.finish(5.0 if self.build.done() else 0.0)
            shutil.rmtree(self.job, ignore_errors=True)
        seconds = time.monotonic() - self.started
        code = self.build.proc.returncode
        if not ok and code in (-signal.SIGINT, -signal.SIGTERM) and seconds < TIMEOUT_S:
            self.interrupted = True  # a shutdown's signal: no verdict on the model, the next start rehearses again
            return False
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(json.dumps({"ok": ok, "seconds": round(seconds, 1)}))
        except OSError:
            log.warning("could not write %s", self.marker, exc_info=True)
        return ok

    def stop(self) -> None:
        with self._lock:
            self.build.kill()
            shutil.rmtree(self.job, ignore_errors=True)


def start(model_path: Path, model_type: str, config: ServerConfig, held=()) -> Rehearsal | None:
    """On CUDA with a kernel cache, for a model whose fused kernels it never held: start the
    rehearsal and turn MLX's compile off in this process. None: compile stays as it is."""
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache or not config.warmup or os.environ.get("MLX_DISABLE_COMPILE"):
        return None
    try:
        done = marker(Path(cache), model_path, config)
        if done.exists():
            return None
        weights = _weights_bytes(model_path)
    except OSError:
        return None
    if weights > WEIGHTS_SHARE * device_memory_bytes():
        log.info("the model's fused kernels compile during warm-up (a second copy of its weights would not fit)")
        return None
    try:
        rehearsal = Rehearsal(model_path, model_type, config, Path(cache), done, held, weights)
    except OSError:
        log.warning("could not start the compile rehearsal; the fused kernels compile during warm-up", exc_info=True)
        return None
    mx.disable_compile()
    return rehearsal


def compile_again() -> None:
    """Undo `start`'s switch: an engine that stopped before its rehearsal ended, in a process
    that may run another."""
    mx.enable_compile()


def main(argv: list[str] | None = None) -> int:
    """The side process: load the model as the engine does, wait for its warm-up prompts, warm up
    with compile on (MLX files each fused kernel in this process's cache), and exit."""
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.ops import kernel_disk_cache, many_row_dequantized
    from vlmserve.engine.runner.tokenizer import TextCodec

    job = Path((sys.argv[1:] if argv is None else argv)[0])
    # Errors only: nobody reads its stderr before it exits, and a full pipe would block it.
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the engine process ignores them; this one ends
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.nice(5)  # the engine's own work comes first where cores run short
    except OSError:
        pass
    with open(job / "config.pkl", "rb") as f:
        config, model_path, model_type, held, engine = pickle.load(f)
    threading.Thread(target=_exit_with, args=(engine,), name="engine-watch", daemon=True).start()
    kernel_disk_cache.keep_off()  # the engine files vlmserve's kernels; the hand-over brings them here
    many_row_dequantized.hold({tuple(s) for s in held})  # as the engine serves until its builds land
    model_path = Path(model_path)
    core = EngineCore.load(config, model_path, model_type, TextCodec(model_path))
    if not many_row_dequantized.installed(core.model.model):
        many_row_dequantized.reset()
    prompts_file, deadline = job / "prompts.pkl", time.monotonic() + _JOB_WAIT_S
    while not prompts_file.exists():
        if time.monotonic() > deadline:
            return 3  # the engine never warmed up
        time.sleep(0.1)
    with open(prompts_file, "rb") as f:
        prompts = pickle.load(f)
    # Warm-up runs every graph the engine compiles before ready (what it leaves for idle time
    # builds plans and runs more shapes of the same graphs, none of MLX's fused kernels), but for
    # the decode step on another KV dtype's pool, a graph of its own: traced here too.
    core.warm_up(prompts)
    core.warm_wider_shapes()
    mx.synchronize()
    return 0


def _exit_with(engine: int) -> None:
    """End this process once the engine that started it is gone (even before this one began):
    its copy of the weights would otherwise hold device memory that a restarted engine needs."""
    while os.getppid() == engine:
        time.sleep(_WATCH_S)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
