"""Kernel build processes write caches of their own, filed into the shared one by renames
(engine/kernel_staging.py), and the engine waits for them before warm-up in either engine mode."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vlmserve.engine import kernel_staging


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_private_cache_starts_with_links_to_the_shared_one_and_files_only_what_is_new(tmp_path, monkeypatch):
    shared = tmp_path / "ptx"
    old = _write(shared / "gather_1.ptx", "old")
    _write(shared / "sub" / "deep.txt", "names")
    private = kernel_staging.make_private(shared, "qmm")
    assert private.parent == kernel_staging.staging_root(shared) and not private.is_relative_to(shared)
    assert os.path.samefile(private / "gather_1.ptx", old)
    assert (private / "sub" / "deep.txt").read_text() == "names"

    for name in ("qmm_m16.ptx", "qmm_m16.cu", "qmm_m16.txt", "vlmserve-prebuilt/qmm-m16"):
        _write(private / name, name)
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(kernel_staging.os, "replace", lambda a, b: (moved.append(Path(b).name), real_replace(a, b)))
    assert kernel_staging.publish(private, shared) == 4
    # MLX opens a module by its binary and then reads its names: the binary comes last.
    assert moved == ["qmm_m16.txt", "qmm_m16.cu", "qmm-m16", "qmm_m16.ptx"]
    assert (shared / "qmm_m16.ptx").read_text() == "qmm_m16.ptx"
    assert (shared / "vlmserve-prebuilt" / "qmm-m16").exists()
    assert old.read_text() == "old"  # what the shared cache held is left alone


def test_a_module_published_first_by_another_process_is_kept(tmp_path):
    shared, private = tmp_path / "ptx", tmp_path / "mine"
    _write(private / "k.ptx", "mine")
    _write(shared / "k.ptx", "theirs")
    assert kernel_staging.publish(private, shared) == 0
    assert (shared / "k.ptx").read_text() == "theirs"


def test_a_build_files_its_kernels_only_when_it_succeeds(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "ptx"
    shared.mkdir()
    script = tmp_path / "builder.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(os.environ['MLX_PTX_CACHE_DIR'], sys.argv[1] + '.ptx').write_text('built')\n"
        "time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    good = kernel_staging.StagedBuild("builder", ["good", "0"], shared, "t")
    bad = kernel_staging.StagedBuild("builder", ["bad", "3"], shared, "t")
    slow = kernel_staging.StagedBuild("builder", ["slow", "0", "60"], shared, "t")
    failed, _ = kernel_staging.finish_all([good, bad], timeout=60)
    assert failed == 1
    assert (shared / "good.ptx").read_text() == "built"
    assert not (shared / "bad.ptx").exists()
    assert "exit 3" in caplog.text
    assert not slow.finish(timeout=0.5)  # stopped before it ends: what it wrote is not filed
    assert sorted(shared.iterdir()) == [shared / "good.ptx"]
    assert list(kernel_staging.staging_root(shared).iterdir()) == []  # every private cache removed


def test_the_engine_waits_for_kernel_builds_before_warm_up_in_either_engine_mode():
    from types import SimpleNamespace

    from vlmserve.config import ServerConfig
    from vlmserve.engine.inprocess import Engine
    from vlmserve.engine.process_main import CALLS

    order = []

    class Build:
        def finish(self, timeout):
            order.append("build finished")
            return True

    engine = Engine(ServerConfig(model="unused"))
    engine._prebuild = [Build(), Build()]
    engine.core = SimpleNamespace(
        warm_up=lambda prompts: order.append(f"warm-up of {len(prompts)}"),
        cache_gauges=lambda: order.append("gauges read") or "gauges as warm-up left them",
        # The compile rehearsal gets the prompts once the kernels it would otherwise build are filed.
        rehearsal=SimpleNamespace(hand_over=lambda prompts, wait_for: order.append(f"{len(prompts)} handed over")),
    )
    gauges = CALLS["warm_up"](engine)(["a prompt"])  # what an engine process runs for the server's warm_up call
    assert order == ["build finished", "build finished", "1 handed over", "warm-up of 1", "gauges read"]
    assert engine._prebuild == [] and gauges == "gauges as warm-up left them"  # handed to the client


def test_private_caches_left_by_a_killed_engine_are_removed_once_stale(tmp_path):
    import time

    shared = tmp_path / "cache"
    old, fresh = (kernel_staging.make_private(shared, tag) for tag in ("old", "fresh"))
    hour_ago = time.time() - kernel_staging.STALE_S - 60
    os.utime(old, (hour_ago, hour_ago))
    assert kernel_staging.remove_stale(shared) == 1
    assert not old.exists() and fresh.exists()  # a running build's own is kept


def test_a_running_process_gets_copies_names_first_so_its_writes_never_reach_the_shared_cache(tmp_path, monkeypatch):
    shared, private = tmp_path / "ptx", tmp_path / "mine"
    _write(shared / "k.ptx", "binary")
    _write(shared / "k.txt", "names")
    _write(private / "built.ptx", "its own")
    _write(shared / "built.ptx", "another process's")
    landed = []
    real_replace = os.replace
    monkeypatch.setattr(kernel_staging.os, "replace", lambda a, b: (landed.append(Path(b).name), real_replace(a, b)))
    kernel_staging.link_missing(shared, private, copy=True)
    assert landed == ["k.txt", "k.ptx"]  # MLX opens the binary, then reads the names
    assert not os.path.samefile(private / "k.ptx", shared / "k.ptx")
    (private / "k.ptx").write_text("rewritten by the running process")
    assert (shared / "k.ptx").read_text() == "binary"
    assert (private / "built.ptx").read_text() == "its own"  # what it has stays
    assert sorted(p.name for p in private.iterdir()) == ["built.ptx", "k.ptx", "k.txt"]  # no temporaries left
