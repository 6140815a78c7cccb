"""vlmserve serve keeps compiled GPU kernels under the user's cache directory, unless told otherwise."""

from __future__ import annotations

from vlmserve import kernel_cache


def test_kernel_caches_go_under_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.delenv("CUDA_CACHE_MAXSIZE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ptx = kernel_cache.use_persistent_kernel_cache()
    assert ptx.parent == tmp_path / "vlmserve" / "mlx-ptx" and ptx.name  # per MLX version
    assert int(kernel_cache.os.environ["CUDA_CACHE_MAXSIZE"]) == kernel_cache.DRIVER_CACHE_BYTES


def test_the_environment_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("CUDA_CACHE_MAXSIZE", "1000")
    assert kernel_cache.use_persistent_kernel_cache() == tmp_path / "mine"
    assert kernel_cache.os.environ["CUDA_CACHE_MAXSIZE"] == "1000"
