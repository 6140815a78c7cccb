"""`--in-process MODEL`: the vlmserve server (same scheduler, same batching) on 127.0.0.1 in a thread.

The caption run then talks to it over loopback exactly as to a remote server. The engine is
imported here, lazily, and nowhere else in vlmserve.caption.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def in_process_server(
    model: str, max_num_seqs: int | None = None, api_key: str | None = None, log_level: str = "warning"
) -> Iterator[tuple[str, str]]:
    """Yield (base_url, model_id) of a vlmserve server running `model` in this process."""
    try:
        import uvicorn

        from vlmserve.config import ServerConfig
        from vlmserve.entrypoints.openai.app import create_app
        from vlmserve.entrypoints.openai.http_protocol import BulkBodyProtocol
    except ImportError as exc:  # pragma: no cover - a partial install
        raise RuntimeError(f"--in-process needs the vlmserve server and its engine ({exc})") from exc

    port = free_port()
    wanted = {
        "model": model,
        "host": "127.0.0.1",
        "port": port,
        "log_level": log_level,
        "api_key": api_key,
        "max_num_seqs": max_num_seqs,
    }
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    config = ServerConfig(**{k: v for k, v in wanted.items() if k in names and v is not None})
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level=log_level,
            loop=config.event_loop,
            http=BulkBodyProtocol,
            timeout_graceful_shutdown=5,
        )
    )
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.run()
        except BaseException as exc:  # noqa: BLE001 - uvicorn raises SystemExit on a failed lifespan
            errors.append(exc)

    thread = threading.Thread(target=serve, name="vlmserve-in-process", daemon=True)
    thread.start()
    while not server.started:  # the lifespan loads and warms the model first: no deadline (downloads)
        if not thread.is_alive():
            state = getattr(app.state, "server", None)
            reason = getattr(state, "load_error", None) or (repr(errors[0]) if errors else "see the log above")
            raise RuntimeError(f"the in-process server failed to start {model}: {reason}")
        time.sleep(0.05)
    model_id = getattr(config, "model_id", None) or model
    try:
        yield f"http://127.0.0.1:{port}", model_id
    finally:
        server.should_exit = True
        thread.join(60)
