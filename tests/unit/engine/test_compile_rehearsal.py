"""A first start serves uncompiled while a side process compiles MLX's fused kernels
(engine/compile_rehearsal.py): when it rehearses, what the side process is handed and files,
the marker that makes later starts compile from the first step, and the engine's switch."""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlmserve.config import ServerConfig
from vlmserve.engine import compile_rehearsal, kernel_staging

# Stands in for the side process: waits for the prompts, files one "kernel", exits with argv[2].
_FAKE = """
import os, pathlib, pickle, signal, sys, time
job = pathlib.Path(sys.argv[1])
config, model_path, model_type, held, engine = pickle.loads((job / "config.pkl").read_bytes())
while not (job / "prompts.pkl").exists():
    time.sleep(0.02)
prompts = pickle.loads((job / "prompts.pkl").read_bytes())
cache = pathlib.Path(os.environ["MLX_PTX_CACHE_DIR"])
seen = sorted(p.name for p in cache.iterdir())
(cache / "fused_gelu.ptx").write_text(repr((prompts, model_type, held, seen)))
if os.environ.get("FAKE_SIGNAL"):
    os.kill(os.getpid(), getattr(signal, os.environ["FAKE_SIGNAL"]))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "m", "hidden_size": 8}))
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "ptx"
    cache.mkdir()
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.delenv("MLX_DISABLE_COMPILE", raising=False)
    monkeypatch.setattr(compile_rehearsal, "device_memory_bytes", lambda: 1 << 30)
    return cache


@pytest.fixture
def compile_switch(monkeypatch):
    """Records the engine's compile switch instead of flipping this test process's MLX."""
    calls = []
    monkeypatch.setattr(compile_rehearsal.mx, "disable_compile", lambda: calls.append("off"))
    return calls


@pytest.fixture
def fake_side_process(tmp_path, monkeypatch):
    (tmp_path / "fake_rehearsal.py").write_text(_FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(compile_rehearsal.Rehearsal, "module", "fake_rehearsal")


def test_the_key_follows_the_model_and_the_options_that_shape_its_graphs(model):
    config = ServerConfig()
    first = compile_rehearsal.key(model, config)
    assert compile_rehearsal.key(model, replace(config, port=9, api_key="k", log_level="debug")) == first
    assert compile_rehearsal.key(model, replace(config, max_num_seqs=64)) != first
    assert compile_rehearsal.key(model, replace(config, warmup_image_sizes=(224,))) != first
    (model / "config.json").write_text(json.dumps({"model_type": "m", "hidden_size": 16}))
    assert compile_rehearsal.key(model, config) != first


def test_no_rehearsal_without_a_kernel_cache_warm_up_or_room_or_after_one_ran(
    model, cache, compile_switch, monkeypatch
):
    config = ServerConfig()
    assert compile_rehearsal.start(model, "m", replace(config, warmup=False)) is None
    monkeypatch.setenv("MLX_DISABLE_COMPILE", "1")  # the operator's choice: nothing to rehearse
    assert compile_rehearsal.start(model, "m", config) is None
    monkeypatch.delenv("MLX_DISABLE_COMPILE")
    monkeypatch.setattr(compile_rehearsal, "device_memory_bytes", lambda: 3000)  # a second copy would not fit
    assert compile_rehearsal.start(model, "m", config) is None
    monkeypatch.setattr(compile_rehearsal, "device_memory_bytes", lambda: 1 << 30)
    marker = compile_rehearsal.marker(cache, model, config)
    marker.parent.mkdir()
    marker.write_text(json.dumps({"ok": False}))  # a failed one counts too: this start compiles in warm-up
    assert compile_rehearsal.start(model, "m", config) is None
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    marker.unlink()
    assert compile_rehearsal.start(model, "m", config) is None
    assert compile_switch == []  # compile was left on every time


def test_a_rehearsal_gets_the_prompts_and_the_cache_of_the_moment_then_files_its_kernels(
    model, cache, compile_switch, fake_side_process
):
    (cache / "gather_early.ptx").write_text("early")
    rehearsal = compile_rehearsal.start(model, "m", ServerConfig(), held={(4, 64)})
    assert rehearsal is not None and compile_switch == ["off"]
    (cache / "gather_late.ptx").write_text("built by another side process meanwhile")
    rehearsal.hand_over(["prompt-a", "prompt-b"])
    while not rehearsal.done():
        time.sleep(0.02)
    assert rehearsal.finish()
    prompts, model_type, held, seen = eval((cache / "fused_gelu.ptx").read_text())  # noqa: S307 - our own repr
    assert prompts == ["prompt-a", "prompt-b"] and model_type == "m" and held == [(4, 64)]
    assert {"gather_early.ptx", "gather_late.ptx"} <= set(seen)
    assert json.loads(rehearsal.marker.read_text())["ok"] is True
    assert list(kernel_staging.staging_root(cache).iterdir()) == []  # its cache and job directory removed
    assert compile_rehearsal.start(model, "m", ServerConfig()) is None  # the next start compiles at once


def test_the_prompts_wait_for_the_kernels_being_filed(model, cache, compile_switch, fake_side_process):
    """The engine's warm-up goes on meanwhile; the side process then finds what was filed instead
    of building it."""
    filed = threading.Event()
    rehearsal = compile_rehearsal.start(model, "m", ServerConfig())
    rehearsal.hand_over(["p"], wait_for=filed.is_set)
    time.sleep(0.3)
    assert not (rehearsal.job / "prompts.pkl").exists() and not rehearsal.done()
    (cache / "custom_kernel_late.ptx").write_text("filed by the engine's build processes")
    filed.set()
    while not rehearsal.done():
        time.sleep(0.02)
    assert rehearsal.finish()
    _, _, _, seen = eval((cache / "fused_gelu.ptx").read_text())  # noqa: S307 - our own repr
    assert "custom_kernel_late.ptx" in seen


def test_a_failed_rehearsal_files_nothing_and_leaves_a_failed_marker(
    model, cache, compile_switch, fake_side_process, monkeypatch, caplog
):
    monkeypatch.setenv("FAKE_EXIT", "2")
    rehearsal = compile_rehearsal.start(model, "m", ServerConfig())
    rehearsal.hand_over([])
    while not rehearsal.done():
        time.sleep(0.02)
    with caplog.at_level(logging.WARNING):
        assert not rehearsal.finish()
    assert not (cache / "fused_gelu.ptx").exists()
    assert json.loads(rehearsal.marker.read_text())["ok"] is False
    assert "exit 2" in caplog.text


def test_a_rehearsal_ended_by_a_signal_leaves_no_marker(model, cache, compile_switch, fake_side_process, monkeypatch):
    """A shutdown's signal is no verdict on the model: the next start rehearses again."""
    monkeypatch.setenv("FAKE_SIGNAL", "SIGTERM")
    rehearsal = compile_rehearsal.start(model, "m", ServerConfig())
    rehearsal.hand_over([])
    while not rehearsal.done():
        time.sleep(0.02)
    assert not rehearsal.finish() and rehearsal.interrupted
    assert not rehearsal.marker.exists()
    # Killed outright (the kernel's out-of-memory killer, a crash): a failure, with its marker.
    monkeypatch.setenv("FAKE_SIGNAL", "SIGKILL")
    again = compile_rehearsal.start(model, "m", ServerConfig())
    assert again is not None
    again.hand_over([])
    while not again.done():
        time.sleep(0.02)
    assert not again.finish() and not again.interrupted
    assert json.loads(again.marker.read_text())["ok"] is False


def test_the_side_process_gets_the_engines_config_for_one_process(model, cache, compile_switch, fake_side_process):
    config = replace(ServerConfig(), engine_process=True, thread_guard=True, max_num_seqs=7)
    rehearsal = compile_rehearsal.start(model, "m", config)
    try:
        sent, path, model_type, held, engine = pickle.loads((rehearsal.job / "config.pkl").read_bytes())
        assert (sent.max_num_seqs, sent.engine_process, sent.thread_guard) == (7, False, False)
        assert Path(path) == model and model_type == "m" and held == [] and engine == os.getpid()
    finally:
        rehearsal.stop()
    assert not rehearsal.job.exists()


class _Rehearsal:
    def __init__(self, ok: bool, ended: bool = True, interrupted: bool = False):
        self.ok, self.ended, self.started, self.finished = ok, ended, 0.0, 0
        self.interrupted = interrupted

    def done(self):
        return self.ended

    def finish(self):
        self.finished += 1
        return self.ok


class _Model:
    """What the KV budget reads of a model: 2 layers, 2 heads of 4 + 4 dims, bfloat16 (64 bytes a position)."""

    def kv_layout(self):
        return 2, (2, 4, 4), SimpleNamespace(size=2)

    def state_layout(self):
        return [None, None]  # both layers KV: no state to set aside


def _core(rehearsal, monkeypatch):
    from vlmserve.engine import core as core_module
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.sched.kv_budget import KVBudget

    log = []
    monkeypatch.setattr(core_module.mx, "enable_compile", lambda: log.append("compile on"))
    monkeypatch.setattr(core_module, "pages_kv", lambda model: True)
    core = SimpleNamespace(
        rehearsal=rehearsal,
        runner=SimpleNamespace(batches=SimpleNamespace(retrace=lambda: log.append("retrace"))),
        model=_Model(),
        info=SimpleNamespace(context_length=1600),  # 100 blocks
        # A row in each state: each holds KV the uncompiled kernels computed.
        sched=SimpleNamespace(
            prefilling=[SimpleNamespace(kv_reusable=True)],
            running=[SimpleNamespace(kv_reusable=True)],
            preempted=[SimpleNamespace(kv_reusable=True)],
            kv_budget=KVBudget(1000, 16),  # 1,000 blocks of 16 positions: 1 KiB a block
            max_num_seqs=2,
            prefill_chunk=64,
        ),
        _warm_shapes=[(1, 32), (2, 32)],
        _shapes_to_warm=[],
    )
    core._rehearsal_ended = lambda: EngineCore._rehearsal_ended(core)
    core.forget_prefixes = lambda: log.append("prefixes forgotten")
    core._kernels_replaced = lambda: EngineCore._kernels_replaced(core)
    core._end_rehearsal = lambda: EngineCore._end_rehearsal(core)
    core.set_aside_for_rehearsal = lambda weights, working: EngineCore.set_aside_for_rehearsal(core, weights, working)
    return core, log


def _rows(core):
    return [seq for seqs in (core.sched.prefilling, core.sched.running, core.sched.preempted) for seq in seqs]


def test_the_kv_budget_lends_the_rehearsal_what_its_copy_holds_until_it_ends(monkeypatch):
    core, log = _core(_Rehearsal(ok=True), monkeypatch)
    # Its weights (100 KiB), a pool like the engine's first (2 rows x 2 chunks = 256 positions:
    # 16 blocks) and its working memory (20 KiB): 136 blocks.
    core.set_aside_for_rehearsal(100 << 10, 20 << 10)
    assert core.sched.kv_budget.total == 1000 - 136  # the pools grow no further (BlockPool.most reads it)
    assert core.sched.kv_budget.lent == 136 and core.sched.kv_budget.full == 1000  # what a prompt is measured against
    core._end_rehearsal()
    assert core.sched.kv_budget.total == 1000 and core.sched.kv_budget.lent == 0
    core.set_aside_for_rehearsal(10 << 20, 0)  # never more than half of it
    assert core.sched.kv_budget.total == 500
    core.rehearsal = _Rehearsal(ok=True)
    core._end_rehearsal()
    core.info.context_length = 12_000  # 750 blocks: one row at the announced context still fits
    core.set_aside_for_rehearsal(10 << 20, 0)
    assert core.sched.kv_budget.total == 751


def test_the_engine_compiles_once_the_rehearsal_filed_its_kernels(monkeypatch):
    rehearsal = _Rehearsal(ok=True, ended=False)
    core, log = _core(rehearsal, monkeypatch)
    assert not core._rehearsal_ended()  # still compiling: the engine stays uncompiled
    rehearsal.ended = True
    assert core._rehearsal_ended()
    core._end_rehearsal()
    # Cached KV and features came from the uncompiled ops: dropped, and the rows in flight never
    # store theirs, so no later output depends on them.
    assert log == ["compile on", "retrace", "prefixes forgotten"] and core._shapes_to_warm == [(1, 32), (2, 32)]
    assert not any(seq.kv_reusable for seq in _rows(core))
    assert core.rehearsal is None and not core._rehearsal_ended() and rehearsal.finished == 1


def test_after_a_failed_rehearsal_the_engine_stays_uncompiled(monkeypatch, caplog):
    core, log = _core(_Rehearsal(ok=False), monkeypatch)
    with caplog.at_level(logging.WARNING):
        core._end_rehearsal()
    assert log == [] and core._shapes_to_warm == [] and core.rehearsal is None
    assert all(seq.kv_reusable for seq in _rows(core))  # the same kernels serve on
    assert "stays uncompiled" in caplog.text


def test_a_rehearsal_stopped_by_a_shutdown_is_not_reported_as_failed(monkeypatch, caplog):
    core, log = _core(_Rehearsal(ok=False, interrupted=True), monkeypatch)
    with caplog.at_level(logging.INFO):
        core._end_rehearsal()
    assert log == [] and core.rehearsal is None
    assert "was stopped" in caplog.text and "failed" not in caplog.text
