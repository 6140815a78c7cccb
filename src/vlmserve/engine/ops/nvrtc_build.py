"""Compile CUDA sources to cubins with NVRTC, in a process of its own, for MLX's kernel cache.

Run by kernel_disk_cache (never imported by the engine's hot path): it reads a JSON list of
jobs on stdin, compiles each with the NVRTC library MLX itself loaded, and files each cubin
where MLX's kernel cache looks for it. No MLX import here: importing MLX would open a CUDA
context (about half a GiB of device memory) that compiling does not need.

    python -m vlmserve.engine.ops.nvrtc_build < JOBS.json
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


class NvrtcError(RuntimeError):
    pass


def load_library(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NvrtcError(f"cannot load {path}: {e}") from e
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


def _strings(values: list[str]):
    array = (ctypes.c_char_p * len(values))()
    array[:] = [v.encode() for v in values]
    return array


def compile_cubin(
    lib: ctypes.CDLL,
    source: str,
    file_name: str,
    name_expressions: list[str],
    options: list[str],
    headers: dict[str, str],
) -> tuple[bytes, dict[str, str]]:
    """The cubin of `source` and the lowered (mangled) name of each name expression."""
    prog = ctypes.c_void_p()
    names = list(headers)
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog),
            source.encode(),
            file_name.encode(),
            len(names),
            _strings([headers[n] for n in names]),
            _strings(names),
        ),
        "nvrtcCreateProgram",
    )
    try:
        for name in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        result = lib.nvrtcCompileProgram(prog, len(options), _strings(options))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, text)
            raise NvrtcError(f"compile failed: {text.value.decode(errors='replace')[-2000:]}")
        lowered = {}
        for name in name_expressions:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[name] = out.value.decode()
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def write_module(path: Path, binary: bytes, lowered: dict[str, str]) -> None:
    """File a module as MLX's kernel cache reads it: NAME.ptx (here a cubin) and NAME.txt (one
    "name<TAB>lowered name" line per kernel). The .txt goes first and each file lands whole
    (rename), since MLX reads the .txt once it finds the .ptx."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data in (
        (path.with_suffix(".txt"), "".join(f"{k}\t{v}\n" for k, v in lowered.items()).encode()),
        (path, binary),
    ):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise


def run_jobs(jobs: list[dict]) -> tuple[int, int]:
    """Compile and file each job ({nvrtc, path, kernel, source, options, headers}); (built, failed)."""
    libraries: dict[str, ctypes.CDLL] = {}
    built = failed = 0
    for job in jobs:
        path = Path(job["path"])
        if path.exists():
            continue
        try:
            if job["nvrtc"] not in libraries:
                libraries[job["nvrtc"]] = load_library(job["nvrtc"])
            binary, lowered = compile_cubin(
                libraries[job["nvrtc"]],
                job["source"],
                path.stem + ".cu",
                [job["kernel"]],
                job["options"],
                job["headers"],
            )
            write_module(path, binary, lowered)
        except (NvrtcError, OSError) as e:  # a kernel MLX compiles itself at each start, as before
            failed += 1
            log.warning("%s not cached: %s", job["kernel"], e)
            continue
        built += 1
    return built, failed


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        os.nice(5)  # the server's own threads come first; as high as the indexing builds, as warm-up may wait for both
    except OSError:
        pass
    t0 = time.perf_counter()
    built, failed = run_jobs(json.loads(sys.stdin.read()))
    print(json.dumps({"built": built, "failed": failed, "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
