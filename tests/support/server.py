"""In-process vlmserve servers on loopback: uvicorn and the app on a background thread."""

from __future__ import annotations

import threading
import time

import httpx

from support.helpers import MODELS, free_port, metric_value


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

    def wait_warm(self, timeout: float = 120.0) -> RunningServer:
        """Until the warm-up left for idle time is done (`vlmserve:warmup_pending` reads 0): it
        runs model forwards of its own, which a test counting forwards must not see."""
        deadline = time.monotonic() + timeout
        while True:
            if metric_value(httpx.get(f"{self.base_url}/metrics").text, "warmup_pending") == 0:
                return self
            if time.monotonic() > deadline:
                raise TimeoutError("the idle warm-up did not finish")
            time.sleep(0.05)

    @property
    def engine(self):
        return self.state.engine

    def on_worker(self, fn, *args, **kwargs):
        """Run fn on the MLX worker thread (where references must be computed too)."""
        return self.engine.worker.submit(fn, *args, **kwargs).result(timeout=300)

    def client(self, timeout: float = 120, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, **kwargs)

    @property
    def model_id(self) -> str:
        return self.config.model_id


def start_server(model: str, start_timeout: float = 120.0, **overrides) -> RunningServer:
    """A server of the committed fixture `model` (a name under fixtures/models, or a path)."""
    from vlmserve.config import ServerConfig

    path = model if "/" in str(model) else MODELS / model
    config = ServerConfig(model=str(path), port=free_port(), **overrides)
    return RunningServer(config).start(start_timeout)


def chat_turns(server: RunningServer, questions, image: str | None = None, max_tokens: int = 8) -> list[dict]:
    """A greedy chat about `image` (in its first turn; none: text only), each question sent after
    the previous answer, which goes back as the assistant's turn; the replies."""
    messages, replies = [], []
    with server.client() as client:
        for question in questions:
            content = [{"type": "text", "text": question}]
            if image and not messages:
                content.insert(0, {"type": "image_url", "image_url": {"url": image}})
            messages.append({"role": "user", "content": content})
            body = {"model": server.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            replies.append(r.json())
            messages.append({"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]})
    return replies
