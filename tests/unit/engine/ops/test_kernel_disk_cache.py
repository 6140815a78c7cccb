"""vlmserve's CUDA kernels in MLX's kernel cache: the module name MLX looks for, and the round trip."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.helpers import on_own_thread


def test_the_hash_is_libstdcxx_std_hash_of_a_string():
    from vlmserve.engine.ops.kernel_disk_cache import cxx_string_hash

    # printf("%zx", std::hash<std::string>{}(s)) with g++ / libstdc++ on x86-64
    expected = {
        b"": 0x553E93901E462A6E,
        b"a": 0x454DDEE488C1ED6B,
        b"abcdefg": 0xDEEE6830A3AF82AF,
        b"abcdefgh": 0x783DB3E38DB898BB,
        b"hello world, kernels": 0xB687B31624E94FA1,
        bytes((i * 7 + 3) % 256 for i in range(5000)): 0x435E4D1A9BA2DD7C,
    }
    for data, value in expected.items():
        assert cxx_string_hash(data) == value, data[:20]


def test_the_generated_source_is_mlxs():
    """Inputs with and without shape parameters, a 0-d input, two outputs, every kind of template
    argument: the text MLX's build_kernel writes, and the kernel name it derives."""

    def work():
        import mlx.core as mx

        from vlmserve.engine.ops.kernel_disk_cache import generated_source

        x = mx.zeros((2, 3), dtype=mx.bfloat16)
        n = mx.array(3, dtype=mx.int32)
        source = "out[0] = x[x_strides[0]] + n[0];\n"
        return generated_source(
            "demo",
            source,
            ("x", "n"),
            [x, n],
            ("out", "aux"),
            [mx.float32, mx.uint32],
            [("T", mx.bfloat16), ("D", 64), ("CAUSAL", True), ("SPLIT", False)],
        )

    name, source = on_own_thread(work)
    assert name == "custom_kernel_demo_bfloat16_t_64_t_f"
    assert source == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_demo_bfloat16_t_64_t_f(\n"
        "    const __nv_bfloat16* x,\n"
        "    const __grid_constant__ Strides x_strides,\n"
        "    const int32_t* n,\n"
        "    float* out,\n"
        "    uint32_t* aux) {\n"
        "  using T = __nv_bfloat16;\n"
        "  constexpr int D = 64;\n"
        "  constexpr bool CAUSAL = true;\n"
        "  constexpr bool SPLIT = false;\n"
        "\n"
        "out[0] = x[x_strides[0]] + n[0];\n"
        "\n}\n\n} // namespace mlx::core::cu\n"
    )


def test_module_paths_split_long_names_as_mlx_does(tmp_path):
    from vlmserve.engine.ops.kernel_disk_cache import module_path

    assert module_path(tmp_path, "k_1f") == tmp_path / "k_1f.ptx"
    name = "a" * 245 + "b" * 245 + "c" * 10
    assert module_path(tmp_path, name) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")
    exact = "d" * 245
    assert module_path(tmp_path, exact) == tmp_path / (exact + ".ptx")


def test_a_module_is_filed_as_mlx_reads_it(tmp_path):
    from vlmserve.engine.ops.nvrtc_build import write_module

    path = tmp_path / "sub" / "custom_kernel_x_12ab.ptx"
    lowered = "_ZN3mlx4core2cu15custom_kernel_xEv"
    write_module(path, b"\x7fELF-cubin", {"mlx::core::cu::custom_kernel_x": lowered})
    assert path.read_bytes() == b"\x7fELF-cubin"
    assert path.with_suffix(".txt").read_text() == f"mlx::core::cu::custom_kernel_x\t{lowered}\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["custom_kernel_x_12ab.ptx", "custom_kernel_x_12ab.txt"]


@pytest.fixture
def filing_here(tmp_path, monkeypatch):
    """A process whose MLX files kernels (a CUDA build of 0.32.1 or later) into tmp_path."""
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kdc, "_FILER", None)
    monkeypatch.setattr(kdc, "_OFF", False)
    monkeypatch.setattr(kdc, "loaded_nvrtc", lambda: tmp_path / "libnvrtc.so.13")
    monkeypatch.setattr(kdc, "names_builds_by_source", lambda: True)
    monkeypatch.setattr(kdc, "_nvrtc_options", lambda nvrtc: ["--stand-in"])
    monkeypatch.setattr(kdc._Filer, "_run", lambda self: None)  # no background filing
    return kdc


def test_each_template_is_looked_up_once_and_only_missing_builds_are_queued(filing_here, tmp_path):
    """The second launch of a template costs no lookup; a build already in the cache is counted,
    not queued."""
    kdc = filing_here

    def work():
        import mlx.core as mx

        launches = []
        body = "out[0] = x[0];\n"
        kernel = kdc.CachedKernel(lambda **kw: launches.append(kw) or ["y"], "demo", ("x",), ("out",), body)
        x16, x32 = mx.zeros((4,), dtype=mx.bfloat16), mx.zeros((4,), dtype=mx.float32)
        call = dict(output_shapes=[(4,)], grid=(4, 1, 1), threadgroup=(4, 1, 1))
        for x in (x16, x16, x32):
            kernel(inputs=[x], output_dtypes=[x.dtype], template=[("T", x.dtype)], **call)
        filer = kdc.filer()
        queued = [(job["path"], job["nvrtc"]) for job in filer._jobs]
        name, source = kdc.generated_source("demo", body, ("x",), [x16], ("out",), [mx.bfloat16], [("T", mx.int8)])
        kdc.module_path(tmp_path, f"{name}_{kdc.cxx_string_hash(source.encode()):x}").write_bytes(b"cubin")
        kernel(inputs=[x16], output_dtypes=[mx.bfloat16], template=[("T", mx.int8)], **call)
        return len(launches), queued, filer.found, len(filer._jobs)

    launches, queued, found, still_queued = on_own_thread(work)
    assert launches == 4
    assert len(queued) == 2 and len({path for path, _ in queued}) == 2
    assert all(path.startswith(str(tmp_path)) and "custom_kernel_demo_" in path for path, _ in queued)
    assert {nvrtc for _, nvrtc in queued} == {str(tmp_path / "libnvrtc.so.13")}  # MLX's own NVRTC
    assert found == 1 and still_queued == 2


def test_a_launch_never_fails_for_the_filer(filing_here, monkeypatch):
    """A cache directory that cannot be read, say: the launch runs, and filing stops for the process."""
    kdc = filing_here

    def unreadable(self, *args):
        raise PermissionError("cache directory not readable")

    monkeypatch.setattr(kdc._Filer, "note", unreadable)

    def work():
        import mlx.core as mx

        kernel = kdc.CachedKernel(lambda **kw: ["launched"], "demo", ("x",), ("out",), "out[0] = x[0];\n")
        x = mx.zeros((4,), dtype=mx.float32)
        launch = dict(output_shapes=[(4,)], grid=(4, 1, 1), threadgroup=(4, 1, 1))
        out = kernel(inputs=[x], output_dtypes=[mx.float32], **launch)
        return out, kdc.filer()

    out, filer_after = on_own_thread(work)
    assert out == ["launched"] and filer_after is None


def test_nothing_is_filed_where_mlx_would_not_read_it(tmp_path, monkeypatch):
    """No cache directory of its own, no NVRTC loaded, or an MLX that names builds otherwise."""
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    nvrtc = tmp_path / "libnvrtc.so.13"
    for cache, loaded, by_source, expected in (
        (str(tmp_path), nvrtc, True, True),
        (None, nvrtc, True, False),
        (str(tmp_path), None, True, False),
        (str(tmp_path), nvrtc, False, False),
    ):
        monkeypatch.setattr(kdc, "_FILER", None)
        monkeypatch.setattr(kdc, "_OFF", False)
        if cache:
            monkeypatch.setenv("MLX_PTX_CACHE_DIR", cache)
        else:
            monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
        monkeypatch.setattr(kdc, "loaded_nvrtc", lambda loaded=loaded: loaded)
        monkeypatch.setattr(kdc, "names_builds_by_source", lambda by_source=by_source: by_source)
        assert (kdc.filer() is not None) is expected, (cache, loaded, by_source)


_ROUND_TRIP = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    import numpy as np
    from vlmserve.engine.ops import cuda_kernels, kernel_disk_cache as kdc

    source = "int i = threadIdx.x; out[i] = static_cast<float>(x[i * x_strides[0]]) * SCALE + BUMP;"
    if sys.argv[1] == "tamper":  # file another body under this kernel's module name
        from vlmserve.engine.ops import nvrtc_build
        x = mx.zeros((64,), dtype=mx.bfloat16)
        template = [("SCALE", 2), ("BUMP", 0)]
        name, whole = kdc.generated_source(
            "rt", cuda_kernels.compact(source), ("x",), [x], ("out",), [mx.float32], template
        )
        path = kdc.module_path(kdc.filer().cache_dir, f"{name}_{kdc.cxx_string_hash(whole.encode()):x}")
        headers = {"mlx/backend/cuda/device/utils.cuh": kdc._UTILS_STAND_IN}
        nvrtc = kdc.loaded_nvrtc()
        binary, lowered = nvrtc_build.compile_cubin(
            nvrtc_build.load_library(str(nvrtc)), whole.replace("+ BUMP", "+ 1000.0f"), "t.cu",
            ["mlx::core::cu::" + name], kdc._nvrtc_options(nvrtc), headers,
        )
        nvrtc_build.write_module(path, binary, lowered)
    kernel = cuda_kernels.kernel("rt", ("x",), source, ensure_row_contiguous=False)
    x = mx.arange(128, dtype=mx.bfloat16)[::2]
    y = kernel(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1), threadgroup=(64, 1, 1),
               template=[("SCALE", 2), ("BUMP", 0)])[0]
    out = np.array(y).tolist()
    filer = kdc.filer()
    found = filer.found
    filer.flush()
    print(json.dumps({"out": out, "found": found, "filed": filer.filed}))
    """
)


@pytest.mark.gpu
def test_a_restart_loads_the_filed_kernel_and_it_computes_the_same(tmp_path):
    """First run: MLX compiles, the filer files it; second run: MLX finds and loads it (same output).
    Then a cubin of another body filed under the kernel's name is what MLX runs: the name matches."""
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path / "cache")}

    def run(mode: str, cache: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _ROUND_TRIP, mode],
            env={**env, "MLX_PTX_CACHE_DIR": str(tmp_path / cache)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run("plain", "cache"), run("plain", "cache")
    assert first["found"] == 0 and first["filed"] == 1
    assert second["found"] == 1 and second["filed"] == 0
    assert first["out"] == second["out"] == [2.0 * (2 * i) for i in range(64)]
    tampered = run("tamper", "other")
    assert tampered["found"] == 1
    assert tampered["out"] == [2.0 * (2 * i) + 1000.0 for i in range(64)]


def test_the_build_process_files_what_compiles_and_skips_the_rest(tmp_path, monkeypatch):
    """A module already filed is not compiled again; one that fails to compile files nothing."""
    from vlmserve.engine.ops import nvrtc_build

    compiled = []

    def compile_cubin(lib, source, file_name, names, options, headers):
        compiled.append(source)
        if "broken" in source:
            raise nvrtc_build.NvrtcError("compile failed: error: identifier is undefined")
        return b"cubin:" + source.encode(), {names[0]: "_Z" + names[0]}

    def load_library(path):
        if "missing" in path:
            raise nvrtc_build.NvrtcError(f"cannot load {path}")
        return object()

    monkeypatch.setattr(nvrtc_build, "load_library", load_library)
    monkeypatch.setattr(nvrtc_build, "compile_cubin", compile_cubin)
    (tmp_path / "filed.ptx").write_bytes(b"earlier")
    jobs = [
        {"nvrtc": nvrtc, "path": str(tmp_path / name), "kernel": f"k_{source}", "source": source}
        | {"options": [], "headers": {}}
        for nvrtc, name, source in (
            ("/lib/libnvrtc.so.13", "filed.ptx", "old"),
            ("/lib/libnvrtc.so.13", "new.ptx", "fine"),
            ("/lib/libnvrtc.so.13", "bad.ptx", "broken"),
            ("/missing/libnvrtc.so.13", "lost.ptx", "fine too"),
        )
    ]
    assert nvrtc_build.run_jobs(jobs) == (1, 2)
    assert compiled == ["fine", "broken"]
    assert (tmp_path / "filed.ptx").read_bytes() == b"earlier"
    assert (tmp_path / "new.ptx").read_bytes() == b"cubin:fine"
    assert (tmp_path / "new.txt").read_text() == "k_fine\t_Zk_fine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["filed.ptx", "new.ptx", "new.txt"]


def test_a_build_process_that_cannot_start_costs_only_a_warning(tmp_path, caplog, monkeypatch):
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    job = {"path": str(tmp_path / "k.ptx"), "kernel": "k", "source": "", "options": [], "headers": {}}
    with caplog.at_level("WARNING"):
        filer._file([job])
    assert filer.filed == 0 and not (tmp_path / "k.ptx").exists()
    assert "could not file 1 CUDA kernels" in caplog.text and "did not run" in caplog.text


_VERBOSE = textwrap.dedent(
    """
    import json
    import mlx.core as mx
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    source = (
        "int i = threadIdx.x;\\n"
        "out[i] = static_cast<float>(x[i * x_strides[1]]) * D + (C ? n[0] : 0) + x_ndim * 0 + x_shape[0] * 0;\\n"
        "aux[i] = S ? 1u : 2u;\\n"
    )
    names, outputs = ("x", "n"), ("out", "aux")
    kernel = mx.fast.cuda_kernel(name="probe", input_names=list(names), output_names=list(outputs), source=source)
    x, n = mx.ones((4, 2), dtype=mx.bfloat16), mx.array(3, dtype=mx.int32)
    template = [("T", mx.bfloat16), ("D", 5), ("C", True), ("S", False)]
    dtypes = [mx.float32, mx.uint32]
    out = kernel(inputs=[x, n], output_shapes=[(4,), (4,)], output_dtypes=dtypes, grid=(4, 1, 1),
                 threadgroup=(4, 1, 1), template=template, verbose=True)
    mx.eval(out)
    name, whole = kdc.generated_source("probe", source, names, [x, n], outputs, dtypes, template)
    print("\\nOURS " + json.dumps({"name": name, "source": whole, "out": [a.tolist() for a in out]}), flush=True)
    """
)


@pytest.mark.gpu
def test_the_generated_source_is_what_mlx_prints():
    """MLX's own text (cuda_kernel's verbose print) for shape, strides and ndim parameters, a
    0-d input, two outputs and dtype, int and bool template arguments."""
    done = subprocess.run([sys.executable, "-c", _VERBOSE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed, ours = done.stdout.split("\nOURS ")
    ours = json.loads(ours)
    header, _, rest = printed.partition("```\n")
    assert f"`{ours['name']}`" in header
    assert rest[: rest.rindex("\n```")] == ours["source"]
    assert ours["out"] == [[8.0] * 4, [2] * 4]


def test_a_build_noted_ahead_of_its_first_use_is_queued_once_and_not_launched(filing_here):
    kdc = filing_here

    def work():
        import mlx.core as mx

        launches = []
        kernel = kdc.CachedKernel(lambda **kw: launches.append(kw) or ["y"], "ahead", ("x",), ("out",), "out[0] = 1;")
        x = mx.zeros((4,), dtype=mx.float32)
        kernel.note(inputs=[x], output_dtypes=[x.dtype], template=[("N", 4)])
        queued_by_note = len(kdc.filer()._jobs)
        kernel(inputs=[x], output_dtypes=[x.dtype], template=[("N", 4)], output_shapes=[(4,)], grid=(1, 1, 1))
        return len(launches), queued_by_note, len(kdc.filer()._jobs)

    launches, queued_by_note, queued = on_own_thread(work)
    assert queued_by_note == 1 and launches == 1 and queued == 1  # the launch found it queued


def test_a_filing_splits_its_builds_over_processes_side_by_side(tmp_path, monkeypatch, caplog):

    from vlmserve.engine.ops import kernel_disk_cache as kdc

    together, lock, parts = threading.Barrier(3, timeout=30), threading.Lock(), []

    def build_in_process(jobs):
        together.wait()  # raises unless three processes run at once
        with lock:
            parts.append([job["path"] for job in jobs])
        return {"built": len(jobs) - (jobs[0]["path"] == "bad"), "failed": int(jobs[0]["path"] == "bad")}, "nvrtc: bad"

    monkeypatch.setattr(kdc, "SIDE_PROCESSES", 3)
    monkeypatch.setattr(kdc, "_build_in_process", build_in_process)
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    jobs = [{"path": p} for p in ("bad", "a", "b", "c", "d")]
    with caplog.at_level("INFO"):
        filer._file(jobs)
    assert len(parts) == 3 and sorted(sum(parts, [])) == sorted(job["path"] for job in jobs)
    assert filer.filed == 4
    assert "filed 4 of vlmserve's CUDA kernels in the kernel cache for the next start (1 failed)" in caplog.text
    assert "1 CUDA kernels could not be filed: nvrtc: bad" in caplog.text
    assert "/5 done (" not in caplog.text  # a quick filing says nothing on the way


def test_a_long_filing_says_how_far_it_got(tmp_path, monkeypatch, caplog):
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    monkeypatch.setattr(kdc, "SIDE_PROCESSES", 3)
    monkeypatch.setattr(kdc, "PROGRESS_S", 0.0)
    monkeypatch.setattr(kdc, "_build_in_process", lambda jobs: ({"built": len(jobs), "failed": 0}, ""))
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    with caplog.at_level("INFO"):
        filer._file([{"path": p} for p in ("a", "b", "c", "d", "e")])
    progress = [r.getMessage().split(" (")[0] for r in caplog.records if "/5 done (" in r.getMessage()]
    assert len(progress) == 2  # after each process but the last: n of N so far
    assert progress[-1] in ("vlmserve's CUDA kernels: 3/5 done", "vlmserve's CUDA kernels: 4/5 done")


def test_the_filer_is_busy_while_builds_are_queued_or_being_filed(tmp_path, monkeypatch):
    """What `warmup_pending` counts: builds waiting to be filed, then the filing itself."""
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    inside, release, seen = threading.Event(), threading.Event(), []

    def build_in_process(jobs):
        inside.set()
        release.wait(10)
        return {"built": len(jobs), "failed": 0}, ""

    monkeypatch.setattr(kdc, "_build_in_process", build_in_process)
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    assert not filer.busy()
    filer._jobs.append({"path": str(tmp_path / "a.ptx")})
    seen.append(filer.busy())  # queued, but no filing thread runs: nothing will file it
    filer._thread = SimpleNamespace(is_alive=lambda: True)
    seen.append(filer.busy())  # queued
    worker = threading.Thread(target=filer.flush)
    worker.start()
    inside.wait(10)
    seen.append(filer.busy())  # being filed: the queue is empty, the filing not over
    release.set()
    worker.join(10)
    assert seen == [False, True, True] and not filer.busy()


def test_a_filing_that_raises_leaves_the_filing_thread_to_file_the_next(tmp_path, monkeypatch, caplog):
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    filed = threading.Event()
    calls = []

    def build(jobs):
        calls.append([job["path"] for job in jobs])
        if len(calls) == 1:
            raise KeyError("an odd summary")
        filed.set()

    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    monkeypatch.setattr(filer, "_build", build)
    monkeypatch.setattr(kdc, "module_path", lambda cache, name: tmp_path / f"{name}.ptx")
    with caplog.at_level("WARNING"):
        filer.note("first", "k", "src")
        for _ in range(100):  # the first filing (after its quiet second) raises
            if calls:
                break
            time.sleep(0.05)
        filer.note("second", "k", "src")
        assert filed.wait(10)
    assert calls == [[str(tmp_path / "first.ptx")], [str(tmp_path / "second.ptx")]]
    assert "filing kernels in the kernel cache failed" in caplog.text and not filer.busy()


def test_a_filing_builds_what_is_needed_soon_first(tmp_path, monkeypatch):
    """Builds noted `later` (the decode checks') go after the rest, so each process starts on one
    that the first requests need."""
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    parts = []
    monkeypatch.setattr(kdc, "SIDE_PROCESSES", 2)
    monkeypatch.setattr(kdc, "_build_in_process", lambda jobs: parts.append([j["path"] for j in jobs]) or ({}, ""))
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    jobs = [
        {"path": "check-1", "later": True},
        {"path": "check-2", "later": True},
        {"path": "prompt"},
        {"path": "decode"},
    ]
    filer._file(jobs)
    assert sorted(part[0] for part in parts) == ["decode", "prompt"]


def test_hurry_starts_a_filing_without_waiting_for_more(tmp_path, monkeypatch):
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    filed = threading.Event()
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    monkeypatch.setattr(filer, "_build", lambda jobs: filed.set())
    monkeypatch.setattr(kdc, "module_path", lambda cache, name: tmp_path / f"{name}.ptx")
    filer.hurry()  # nothing queued: nothing changes (a later burst still gathers)
    assert not filer._hurry
    filer.note("one", "k", "src")
    t0 = time.monotonic()
    filer.hurry()
    assert filed.wait(10) and time.monotonic() - t0 < 0.8  # not after the quiet second a burst waits for
    for _ in range(100):
        if not filer._hurry:
            break
        time.sleep(0.01)
    assert not filer._hurry  # spent on that filing


def test_await_soon_waits_for_the_builds_needed_soon_not_the_later_ones(tmp_path, monkeypatch):
    """Warm-up's wait on a first start: it returns once the builds not noted `later` are on disk,
    while the later ones are still being built."""
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    later_may_finish = threading.Event()

    def build(jobs):  # the soon ones land one by one, then the later ones wait for the test
        for job in jobs:
            if job.get("later"):
                later_may_finish.wait(10)
            time.sleep(0.05)
            Path(job["path"]).write_bytes(b"cubin")

    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    monkeypatch.setattr(filer, "_build", build)
    monkeypatch.setattr(kdc, "module_path", lambda cache, name: tmp_path / f"{name}.ptx")
    filer._options = ["--stand-in"]
    assert filer.await_soon(5) == (0, 0)  # nothing noted: nothing to wait for
    for name in ("prompt", "decode"):
        filer.note(name, "k", "src")
    filer.note("check", "k", "src", later=True)
    filer.hurry()
    t0 = time.monotonic()
    awaited = filer.await_soon(10)
    took = time.monotonic() - t0
    landed = sorted(p.name for p in tmp_path.glob("*.ptx"))
    later_may_finish.set()
    assert awaited == (2, 2) and landed == ["decode.ptx", "prompt.ptx"]
    assert took < 5  # as they landed, not at the end of the filing or the timeout
    assert filer.await_soon(5) == (0, 0)  # they are on disk now


def test_await_soon_stops_when_the_filing_ends_without_them_or_at_its_timeout(tmp_path, monkeypatch):
    from vlmserve.engine.ops import kernel_disk_cache as kdc

    release = threading.Event()
    filer = kdc._Filer(tmp_path, tmp_path / "libnvrtc.so.13")
    monkeypatch.setattr(filer, "_build", lambda jobs: release.wait(10))  # files nothing (failed builds)
    monkeypatch.setattr(kdc, "module_path", lambda cache, name: tmp_path / f"{name}.ptx")
    filer._options = ["--stand-in"]
    filer.note("prompt", "k", "src")
    filer.hurry()
    t0 = time.monotonic()
    assert filer.await_soon(0.3) == (1, 0)  # the filing goes on: the timeout ends the wait
    assert 0.3 <= time.monotonic() - t0 < 5
    release.set()
    for _ in range(200):
        if not filer.busy():
            break
        time.sleep(0.02)
    t0 = time.monotonic()
    assert filer.await_soon(10) == (1, 0) and time.monotonic() - t0 < 1  # over, the build missing: no wait
