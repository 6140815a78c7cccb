"""`vlmserve serve` flags (vlmserve/cli.py): the config and process settings they give."""

from __future__ import annotations

import os

import pytest


def _serve_config(*flags: str):
    """ServerConfig from `vlmserve serve` flags, as the CLI parses them."""
    import argparse

    from vlmserve.cli import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)))


def test_serve_sets_the_gil_switch_interval_from_its_flag(monkeypatch):
    import sys

    from vlmserve import cli
    from vlmserve.cli import set_process_settings

    kept_out = []
    monkeypatch.setattr(cli, "keep_torch_out", lambda: kept_out.append(True))
    before = sys.getswitchinterval()
    try:
        set_process_settings(_serve_config())
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        set_process_settings(_serve_config("--gil-switch-interval-ms", "2"))
        assert sys.getswitchinterval() == pytest.approx(0.002)
        set_process_settings(_serve_config("--gil-switch-interval-ms", "0"))
        assert sys.getswitchinterval() == pytest.approx(0.002)  # 0 leaves the interpreter's setting
        assert kept_out  # torch stays out of the serving process (torchless.py)
    finally:
        sys.setswitchinterval(before)


def test_serve_turns_cuda_graphs_off_unless_asked_or_the_environment_chose(monkeypatch):
    from vlmserve import cli
    from vlmserve.cli import set_process_settings
    from vlmserve.cuda_graphs import ENV

    monkeypatch.setattr(cli, "keep_torch_out", lambda: None)
    monkeypatch.setattr(cli, "use_persistent_kernel_cache", lambda: None)
    monkeypatch.setattr(cli.sys, "setswitchinterval", lambda seconds: None)
    monkeypatch.setenv(ENV, "")  # recorded first: undone last, the environment is as it was
    seen = []
    for flags, env in (((), None), (("--cuda-graphs",), None), ((), "1"), (("--cuda-graphs",), "0")):
        if env is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, env)
        set_process_settings(_serve_config(*flags))
        seen.append(os.environ[ENV])
    assert seen == ["0", "1", "1", "1"]


def test_serve_runs_the_event_loop_its_flag_names():
    """asyncio's loop by default (uvloop holds the GIL through socket writes); uvloop on request."""
    from types import SimpleNamespace

    from vlmserve.cli import _make_server

    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(stop_serving=None)))
    assert _make_server(app, _serve_config()).config.loop == "asyncio"
    assert _make_server(app, _serve_config("--event-loop", "uvloop")).config.loop == "uvloop"
    with pytest.raises(SystemExit):
        _serve_config("--event-loop", "trio")


def test_serve_runs_the_engine_in_its_own_process_unless_told_not_to():
    assert _serve_config().engine_process is True
    assert _serve_config("--no-engine-process").engine_process is False


def test_mlx_cache_flags_reach_the_config():
    assert _serve_config().mlx_cache_limit_gb == 8.0
    assert _serve_config("--mlx-cache-limit-gb", "2.5").mlx_cache_limit_gb == 2.5
    assert _serve_config().release_cache_after_idle_s == 60.0
    assert _serve_config("--release-cache-after-idle", "5").release_cache_after_idle_s == 5.0


def test_working_memory_flag():
    assert _serve_config().working_memory_gb is None  # a share of the device (engine/memory.py)
    assert _serve_config("--working-memory", "1.5").working_memory_gb == 1.5
    assert _serve_config("--working-memory", "0").working_memory_gb == 0  # MLX's own limit
