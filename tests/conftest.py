"""Shared test fixtures: in-process servers on loopback with the thread guard on.

The tests sit in three tiers that mirror src/vlmserve: unit/ (one module, no model load, no
server), integration/ (a fixture model or the engine without HTTP) and e2e/ (the HTTP server).
Helpers are in support/; this directory is on sys.path, so they import as `support.<module>`.
"""

from __future__ import annotations

import os

import pytest

# A subprocess of e2e/entrypoints/openai/test_operations.py imports these from here.
from support.helpers import IMAGES, chat_body, data_uri  # noqa: F401
from support.server import start_server

os.environ.setdefault("VLMSERVE_THREAD_GUARD", "1")
# The fixtures are float32 and the tests compare float32 results exactly; on CUDA, MLX runs
# float32 matmuls as TF32 unless told not to (read once, at first use).
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def _cuda_kernels_enabled() -> bool:
    """The check the CUDA-only tests make themselves before they skip ("runs on CUDA only")."""
    from vlmserve.engine.ops import cuda_kernels

    return cuda_kernels.enabled()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need MLX's CUDA backend (vlmserve's own kernels): skipped where it is absent."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_kernels_enabled():
        skip = pytest.mark.skip(reason="the kernel runs on CUDA only (gpu: MLX's CUDA backend is not the default)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen_server():
    server = start_server("qwen2_vl")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llava_server():
    server = start_server("llava")
    yield server
    server.stop()


@pytest.fixture(params=["qwen2_vl", "llava"])
def any_server(request):
    return request.getfixturevalue("qwen_server" if request.param == "qwen2_vl" else "llava_server")


@pytest.fixture(scope="session", autouse=True)
def thread_guard_report():
    """Invariant 1, checked over the whole session: no MLX call ran off the worker."""
    from vlmserve.engine.thread_guard import GUARD

    yield GUARD
    assert not GUARD.violations, f"MLX calls off the worker thread: {GUARD.violations[:10]}"
