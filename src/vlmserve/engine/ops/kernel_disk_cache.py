"""vlmserve's own CUDA kernels in MLX's kernel cache, so a restart does not compile them again.

MLX compiles each `mx.fast.cuda_kernel` with NVRTC at its first use in a process (about half
a second to a second each; a 2B model's warm-up meets about ten) and, unlike its own kernels,
never files the result in its kernel cache (MLX_PTX_CACHE_DIR). It does look there first, under
a module name it derives from the kernel's generated source. So at a kernel's first use this
module derives that source and name as MLX does; when the cache lacks it, a process of its own
(nvrtc_build) compiles the same source with MLX's NVRTC, options and include paths and files
the cubin under that name, off every request's path. The next start loads it from disk.

Only the headers MLX compiles into its library (its `device/utils.cuh`, which every such
kernel includes) are not on disk. The kernels here use nothing of it but the CUDA and libcu++
headers it includes and the Shape and Strides types of their parameters, which the stand-in
below includes and declares as MLX does (with MLX's shipped config.h for MAX_NDIM). A kernel
that uses more fails to compile there and is left to MLX's own compile at each start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import mlx.core as mx

from vlmserve.engine.kernel_staging import SIDE_PROCESSES

PROGRESS_S = 5.0  # a filing that has taken this long says how far it got
AWAIT_POLL_S = 0.02  # how often await_soon looks for the builds it waits for

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def cxx_string_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ on a 64-bit platform (its _Hash_bytes), which MLX
    uses to name a custom kernel's module."""
    n = len(data)
    aligned = n & ~7
    h = (_SEED ^ (n * _MUL)) & _MASK
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i : i + 8], "little")
        h ^= (_shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (_shift_mix(h) * _MUL) & _MASK
    return _shift_mix(h)


_CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.float64: "double",
}
# How a dtype template argument reads in the kernel's name (MLX's get_type_string).
_TYPE_NAMES = {**_CUDA_TYPES, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}

_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_UTILS_STAND_IN = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cmath>
#include <cuda/std/complex>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
_MAX_FILE_NAME = 245  # MLX splits longer module names into directories


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "_t" if value else "_f"
    if isinstance(value, int):
        return f"_{value}"
    return "_" + _TYPE_NAMES[value]


def generated_source(
    name: str,
    source: str,
    input_names: tuple[str, ...],
    inputs: list,
    output_names: tuple[str, ...],
    output_dtypes: list,
    template: list,
    header: str = "",
) -> tuple[str, str]:
    """(kernel name, whole source) of a cuda_kernel call, as MLX's build_kernel writes them."""
    kernel_name = "custom_kernel_" + name + "".join(_template_value(v) for _, v in template)
    parts = [_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"]
    parts.append(f"__global__ void {kernel_name}(\n")
    for n, x in zip(input_names, inputs):
        parts.append(f"    const {_CUDA_TYPES[x.dtype]}* {n},\n")
        if x.ndim > 0:
            if n + "_shape" in source:
                parts.append(f"    const __grid_constant__ Shape {n}_shape,\n")
            if n + "_strides" in source:
                parts.append(f"    const __grid_constant__ Strides {n}_strides,\n")
            if n + "_ndim" in source:
                parts.append(f"    const __grid_constant__ int {n}_ndim,\n")
    for i, (n, dtype) in enumerate(zip(output_names, output_dtypes)):
        parts.append(f"    {_CUDA_TYPES[dtype]}* {n}" + (",\n" if i < len(output_names) - 1 else ") {\n"))
    if template:
        for n, v in template:
            if isinstance(v, bool):
                parts.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
            elif isinstance(v, int):
                parts.append(f"  constexpr int {n} = {v};\n")
            else:
                parts.append(f"  using {n} = {_CUDA_TYPES[v]};\n")
        parts.append("\n")
    parts.append(source)
    parts.append("\n}\n\n} // namespace mlx::core::cu\n")
    return kernel_name, "".join(parts)


def module_path(cache_dir: Path, module_name: str) -> Path:
    """Where MLX's kernel cache keeps a module (MLX's get_ptx_path)."""
    path, offset = cache_dir, 0
    if len(module_name) > _MAX_FILE_NAME:
        while len(module_name) - offset > _MAX_FILE_NAME:
            path = path / module_name[offset : offset + _MAX_FILE_NAME]
            offset += _MAX_FILE_NAME
    return path / (module_name[offset:] + ".ptx")


def names_builds_by_source() -> bool:
    """MLX names a custom kernel's module by a hash of its source from 0.32.1 on; before, by
    name and template only, which this module does not file under."""
    found = [int(n) for n in re.findall(r"\d+", mx.__version__)[:3]]
    return tuple(found) >= (0, 32, 1)


def loaded_nvrtc() -> Path | None:
    """The NVRTC library this process loaded (MLX links it): the filer compiles with the very
    same one, so a cubin never comes from another CUDA release than MLX's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libnvrtc.so" in path and "builtins" not in path:
            return Path(path)
    return None


def _include_paths(nvrtc: Path) -> list[str]:
    """MLX's NVRTC include paths: its bundled headers, CCCL, then the CUDA runtime headers of
    its CUDA release (the nvidia wheel's, else CUDA_HOME's, CUDA_PATH's or /usr/local/cuda's)."""
    root = Path(mx.__file__).resolve().parent  # the mlx package (MLX's library is in its lib/)
    paths = [root / "include", root / "include" / "cccl"]
    major = re.search(r"\.so\.(\d+)", nvrtc.name)
    runtime = root.parent / "nvidia" / ("cu13" if major and int(major[1]) >= 13 else "cuda_runtime") / "include"
    if not runtime.is_dir():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        runtime = Path(home) / "include"
    paths.append(runtime)
    return [f"--include-path={p}" for p in paths if p.is_dir()]


def _nvrtc_options(nvrtc: Path) -> list[str]:
    info = mx.device_info()
    major, minor = int(info.get("compute_capability_major", 0)), int(info.get("compute_capability_minor", 0))
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return ["--device-as-default-execution-space", f"--gpu-architecture={arch}", *_include_paths(nvrtc)]


class _Filer:
    """Collects the kernels the cache lacks and files them from a background process."""

    def __init__(self, cache_dir: Path, nvrtc: Path):
        self.cache_dir = cache_dir
        self.nvrtc = nvrtc
        self.found = 0  # builds this process found on disk (MLX reads them instead of compiling)
        self.filed = 0
        self._jobs: list[dict] = []
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._filing = threading.Lock()  # one filing at a time (its builds in up to SIDE_PROCESSES processes)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._options: list[str] | None = None
        self._hurry = False
        self._soon: list[Path] = []  # noted builds not `later`, until seen on disk (await_soon)

    @property
    def queued(self) -> int:
        """Builds this process noted that the cache lacked (queued for side processes to file)."""
        return len(self._queued)

    def busy(self) -> bool:
        """Whether builds are queued (for a filing thread that runs) or being filed."""
        with self._lock:
            queued = bool(self._jobs)
        alive = self._thread is not None and self._thread.is_alive()  # a dead one files nothing more
        return (queued and alive) or self._filing.locked()

    def note(self, module_name: str, kernel_name: str, source: str, later: bool = False) -> None:
        """Queue the build for filing unless the cache holds it (`later`: after the others of its
        filing, as nothing needs it soon)."""
        path = module_path(self.cache_dir, module_name)
        if path.exists():
            self.found += 1
            return
        if self._options is None:
            self._options = _nvrtc_options(self.nvrtc)
        job = {
            "nvrtc": str(self.nvrtc),
            "path": str(path),
            "kernel": "mlx::core::cu::" + kernel_name,
            "source": source,
            "options": self._options,
            "headers": {"mlx/backend/cuda/device/utils.cuh": _UTILS_STAND_IN},
            "later": later,
        }
        with self._lock:
            if job["path"] in self._queued:
                return
            self._queued.add(job["path"])
            self._jobs.append(job)
            if not later:
                self._soon.append(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vlmserve-kernel-filer", daemon=True)
                self._thread.start()
        self._wake.set()

    def await_soon(self, timeout: float) -> tuple[int, int]:
        """Wait until every build noted so far but `later` is on disk, the filing that builds
        them is over (some failed) or `timeout` passed; returns how many builds it waited for and
        how many of those landed.

        Side processes build those side by side, where the first use of each on the MLX thread
        would compile them one after another: on a first start warm-up waits here instead."""
        deadline = time.monotonic() + timeout
        awaited = missing = self._missing_soon()
        while missing and self.busy() and time.monotonic() < deadline:
            time.sleep(AWAIT_POLL_S)
            missing = self._missing_soon()
        return awaited, awaited - missing

    def _missing_soon(self) -> int:
        """How many builds noted for soon use are not on disk yet (those that are, forgotten)."""
        with self._lock:
            self._soon = [path for path in self._soon if not path.exists()]
            return len(self._soon)

    def hurry(self) -> None:
        """Start filing what is queued now, without waiting for more to gather (nothing queued:
        nothing changes, so a later burst still gathers)."""
        with self._lock:
            if not self._jobs:
                return
            self._hurry = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            while True:  # let a burst of first uses (a warm-up, a new shape) gather into one filing
                self._wake.clear()
                if self._hurry or not self._wake.wait(1.0):
                    break
            self._hurry = False
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - those builds are compiled at each start, as before; later ones still filed
                log.warning("filing kernels in the kernel cache failed", exc_info=True)

    def flush(self) -> None:
        """File what is pending now, on this thread, and wait for a filing under way."""
        self._file(None)

    def _file(self, jobs: list[dict] | None) -> None:
        """File `jobs` (None: what is queued, taken once the filing is ours, so the filer is never
        seen idle between its queue and its filing)."""
        with self._filing:
            if jobs is None:
                with self._lock:
                    jobs, self._jobs = self._jobs, []
            if jobs:
                self._build(jobs)

    def _build(self, jobs: list[dict]) -> None:
        """Compile `jobs` in up to SIDE_PROCESSES processes side by side (a build is a second or two
        of one core); log what was filed."""
        t0 = time.perf_counter()
        jobs = sorted(jobs, key=lambda job: job.get("later", False))  # each process builds its share in turn
        count = max(1, min(len(jobs), SIDE_PROCESSES))
        parts = [jobs[i::count] for i in range(count)]
        outcomes: list = [None] * count
        with ThreadPoolExecutor(count) as pool:
            futures = {pool.submit(_build_in_process, part): i for i, part in enumerate(parts)}
            done = 0
            for future in as_completed(futures):
                i = futures[future]
                outcomes[i] = future.result()
                done += len(parts[i])
                took = time.perf_counter() - t0
                if done < len(jobs) and took >= PROGRESS_S:  # a long filing (a first start's): n of N so far
                    log.info("vlmserve's CUDA kernels: %d/%d done (%.0f s)", done, len(jobs), took)
        built = sum(result["built"] for result, _ in outcomes if result)
        failed = sum(result["failed"] for result, _ in outcomes if result)
        for (result, errors), part in zip(outcomes, parts):
            if not result:
                log.warning(
                    "could not file %d CUDA kernels in the kernel cache (each start compiles them): %s",
                    len(part),
                    errors,
                )
            elif result["failed"]:  # such kernels are compiled by MLX at each start, as before
                log.warning("%d CUDA kernels could not be filed: %s", result["failed"], errors)
        self.filed += built
        if built or failed:
            log.info(
                "filed %d of vlmserve's CUDA kernels in the kernel cache for the next start (%d failed) in %.1f s",
                built,
                failed,
                time.perf_counter() - t0,
            )


def _build_in_process(jobs: list[dict]) -> tuple[dict, str]:
    """Run nvrtc_build on `jobs`: its summary ({} if it did not finish) and the end of its stderr."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "vlmserve.engine.ops.nvrtc_build"],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            timeout=60 + 30 * len(jobs),
        )
    except (OSError, subprocess.SubprocessError) as e:  # could not start, or ran past its time
        return {}, f"the build process did not run to its end: {e}"
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    except (ValueError, IndexError):
        result = {}
    return result, done.stderr[-1000:]


_FILER: _Filer | None = None
_OFF = False  # set when filing cannot work here, or failed: MLX compiles at each start, as before


def filer() -> _Filer | None:
    """The process's filer: when MLX's kernel cache has a directory of its own (`vlmserve
    serve` names one), MLX names builds by their source, and its NVRTC is found."""
    global _FILER, _OFF
    if _FILER is None and not _OFF:
        cache, nvrtc = os.environ.get("MLX_PTX_CACHE_DIR"), loaded_nvrtc()
        if cache and nvrtc is not None and names_builds_by_source():
            _FILER = _Filer(Path(cache), nvrtc)
        else:
            _OFF = True
    return _FILER


def keep_off() -> None:
    """File nothing from this process (a side process whose builds the engine files)."""
    global _FILER, _OFF
    _FILER, _OFF = None, True


def switch_off(reason: BaseException) -> None:
    if not _OFF:
        log.warning("vlmserve's CUDA kernels are not filed in the kernel cache (each start compiles them): %r", reason)
    keep_off()


class CachedKernel:
    """An `mx.fast.cuda_kernel` whose builds go to MLX's kernel cache (see the module's doc).

    Each template is looked up once per process (a tuple's hash a launch). Builds that differ
    only in their inputs' or outputs' dtypes under one template are filed for the first only;
    MLX compiles the others at each start, as before."""

    def __init__(self, kernel, name: str, input_names, output_names, source: str):
        self._kernel = kernel
        self._name = name
        self._input_names = tuple(input_names)
        self._output_names = tuple(output_names)
        self._source = source
        self._seen: set = set()

    def __call__(self, *, inputs, output_dtypes, template=None, **kwargs):
        self.note(inputs=inputs, output_dtypes=output_dtypes, template=template)
        return self._kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)

    def note(self, *, inputs, output_dtypes, template=None, later: bool = False) -> None:
        """Queue this build for the kernel cache unless it is there or queued. Called ahead of a
        build's first use, the build compiles in a side process meanwhile and that use reads it
        from disk instead of compiling it on the MLX thread (where it lands in time: a first use
        before that compiles it here, as side processes at a start's busiest are slower than
        this thread). `later`: nothing uses it soon, so its filing builds it after the others."""
        key = tuple(template) if template else ()
        if key not in self._seen:
            self._seen.add(key)
            self._note(inputs, output_dtypes, template or [], later)

    def _note(self, inputs, output_dtypes, template, later: bool = False) -> None:
        target = filer()
        if target is None or not all(isinstance(x, mx.array) for x in inputs):
            return  # scalars become arrays of MLX's choosing: left to MLX's compile
        try:
            kernel_name, source = generated_source(
                self._name, self._source, self._input_names, inputs, self._output_names, output_dtypes, template
            )
            target.note(f"{kernel_name}_{cxx_string_hash(source.encode()):x}", kernel_name, source, later)
        except KeyError:  # a dtype this module does not name: left to MLX's compile
            pass
        except Exception as e:  # noqa: BLE001 - filing is an optimisation; a launch must never fail for it
            switch_off(e)
