"""Compiled GPU kernels are kept under the user's cache directory, unless the environment says otherwise."""

from __future__ import annotations

import os

from vlmserve import kernel_cache

_NAMED = ("MLX_PTX_CACHE_DIR", "CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE", "MLX_ENABLE_CACHE_THRASHING_CHECK")


def test_kernel_caches_go_under_the_users_cache_directory(monkeypatch, tmp_path):
    for name in (*_NAMED, "VLMSERVE_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ptx = kernel_cache.use_persistent_kernel_cache()
    assert ptx.parent == tmp_path / "vlmserve" / "mlx-ptx" and ptx.name  # per MLX version
    assert os.environ["CUDA_CACHE_PATH"] == str(tmp_path / "vlmserve" / "cuda")
    assert int(os.environ["CUDA_CACHE_MAXSIZE"]) == kernel_cache.DRIVER_CACHE_BYTES
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"  # plans for every image size a server meets


def test_the_environment_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("VLMSERVE_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("CUDA_CACHE_PATH", raising=False)
    monkeypatch.setenv("CUDA_CACHE_MAXSIZE", "1000")
    monkeypatch.setenv("MLX_ENABLE_CACHE_THRASHING_CHECK", "1")
    assert kernel_cache.use_persistent_kernel_cache() == tmp_path / "mine"
    assert os.environ["CUDA_CACHE_PATH"] == str(tmp_path / "root" / "cuda")
    assert os.environ["CUDA_CACHE_MAXSIZE"] == "1000"
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"
