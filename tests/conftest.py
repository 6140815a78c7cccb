"""Shared test fixtures: in-process servers on loopback with the thread guard on."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("VLMSERVE_THREAD_GUARD", "1")
# The fixtures are float32 and the tests compare float32 results exactly; on CUDA, MLX runs
# float32 matmuls as TF32 unless told not to (read once, at first use).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "fixtures" / "models"
IMAGES = ROOT / "fixtures" / "images"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_uri(path: Path) -> str:
    mime = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}[
        path.suffix.lower().lstrip(".")
    ]
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


class RunningServer:
    """uvicorn + the vlmserve app in a background thread of this process."""

    def __init__(self, config):
        import uvicorn

        from vlmserve.entrypoints.openai.app import create_app
        from vlmserve.entrypoints.openai.http_protocol import BulkBodyProtocol

        self.config = config
        self.app = create_app(config)
        self.state = self.app.state.server
        self.uv = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=config.port,
                log_level="warning",
                http=BulkBodyProtocol,
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.uv.run, name="uvicorn", daemon=True)
        self.base_url = f"http://127.0.0.1:{config.port}"

    def start(self, timeout: float = 120.0) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uv.started:
            if not self.thread.is_alive():
                raise RuntimeError("server failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)

    @property
    def engine(self):
        return self.state.engine

    def on_worker(self, fn, *args, **kwargs):
        """Run fn on the MLX worker thread (where references must be computed too)."""
        return self.engine.worker.submit(fn, *args, **kwargs).result(timeout=300)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120, **kwargs)

    @property
    def model_id(self) -> str:
        return self.config.model_id


def on_own_thread(fn):
    """Run fn on a fresh thread that owns all its MLX calls (the thread guard counts it as a worker)."""
    result: dict = {}

    def target():
        from vlmserve.engine.thread_guard import GUARD

        ident = threading.get_ident()
        GUARD.owners.add(ident)
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e
        finally:
            GUARD.owners.discard(ident)

    t = threading.Thread(target=target, name="test-mlx")
    t.start()
    t.join(300)
    assert not t.is_alive(), "MLX work on its own thread hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def start_server(model: str, **overrides) -> RunningServer:
    from vlmserve.config import ServerConfig

    config = ServerConfig(model=str(MODELS / model), port=free_port(), **overrides)
    return RunningServer(config).start()


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


def images() -> list[Path]:
    return sorted(p for p in IMAGES.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg"})


def chat_body(model: str, text: str, image_urls=(), **kwargs) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], **kwargs}


def run(coro):
    return asyncio.run(coro)
