"""Paths, request bodies and threads shared by the tests (no MLX import at module level)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import socket
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "fixtures" / "models"
IMAGES = ROOT / "fixtures" / "images"


def token_request(request_id: str, prompt: list[int], sampling) -> tuple:
    """An engine request of these prompt ids (no template, no images), and the list its events go to."""
    import numpy as np

    from vlmserve.engine.sched.request import EngineRequest
    from vlmserve.protocol import PreparedRequest

    events: list = []
    prepared = PreparedRequest(prompt_ids=np.array(prompt, np.int32))
    return EngineRequest(request_id, prepared, sampling, events.append), events


def event_tokens(events: list) -> list[int]:
    """The token ids a request's engine events carried, in order."""
    return [t for e in events for t in e.token_ids]


def run_until_idle(core, steps: int = 500) -> None:
    """Step an EngineCore until it has no work left (on the calling thread); fails past `steps`."""
    for _ in range(steps):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the engine did not finish its work")


def greedy_logits(lm, ids, cache, steps: int) -> list:
    """A language model's last-position logits (float32 NumPy) for `ids` through `cache`, then
    after each of `steps` greedy one-token steps. MLX work: call it on the thread that owns it."""
    import mlx.core as mx
    import numpy as np

    out = []
    for _ in range(steps + 1):
        logits = lm(ids, cache=cache).logits[:, -1, :].astype(mx.float32)
        out.append(np.array(logits))
        ids = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    return out


def padded_greedy_logits(lm, prompts: list[list[int]], steps: int = 3) -> list:
    """`greedy_logits` of the prompts left-padded into one forward through the model's own
    caches (the state layers told the padding). MLX work: call it on the thread that owns it."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    caches = vlm_cache.make_prompt_cache(lm)
    for c in caches:
        if isinstance(c, vlm_cache.ArraysCache):
            c.left_padding = mx.array(pads)  # the state layers mask the padding
    ids = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    return greedy_logits(lm, ids, caches, steps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boxed_image_uri(size: tuple[int, int], colour: tuple, box: tuple, box_colour: tuple) -> str:
    """A PNG data URI of one colour with a box of another: images that differ by pixels only."""
    from PIL import Image

    image = Image.new("RGB", size, colour)
    image.paste(box_colour, box)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def data_uri(path: Path) -> str:
    mime = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}[
        path.suffix.lower().lstrip(".")
    ]
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


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


def images() -> list[Path]:
    return sorted(p for p in IMAGES.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg"})


def chat_body(model: str, text: str, image_urls=(), **kwargs) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], **kwargs}


def greedy_bodies(model: str, cases, max_tokens: int) -> list[dict]:
    """A greedy chat request per (text, image paths) case, the images as data URIs."""
    return [
        chat_body(model, text, [data_uri(p) for p in paths], max_tokens=max_tokens, temperature=0)
        for text, paths in cases
    ]


def metric_value(text: str, name: str) -> float:
    """The value of vlmserve's metric `name` (its one labelled sample) in a /metrics page."""
    line = next(x for x in text.splitlines() if x.startswith(f"vlmserve:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def run(coro):
    return asyncio.run(coro)


def wait_ready(base: str, timeout: float = 120.0) -> bool:
    """Poll a server's /ready (a server in another process) until 200 or `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return True
        time.sleep(0.2)
    return False


def refuse_join_once(request_id: str, refused: list):
    """A stand-in for ModelRunner._take_positions that refuses `request_id`'s join once while its
    prompt is in blocks of a pool (as when rows that arrived before it took the last blocks
    meanwhile), noting how many blocks it held in `refused`; everything else as the runner does."""
    from vlmserve.engine.runner.model_runner import ModelRunner

    take = ModelRunner._take_positions

    def take_positions(self, seq, positions, dtype):
        joining = seq.prefill_pool is not None and positions == seq.cache_len + 1
        if seq.req.request_id == request_id and joining and not refused:
            refused.append(len(seq.prefill_blocks))
            return False
        return take(self, seq, positions, dtype)

    return take_positions


def pool_holding_positions(positions: int, blocks: int):
    """A one-layer KV pool of `blocks` blocks of 8 positions whose first blocks hold `positions`
    positions of known KV (keys counting up, values their negation): (pool, their blocks, keys).
    MLX work: call it on the thread that owns it."""
    import mlx.core as mx

    from vlmserve.engine.runner.block_pool import BlockPool

    pool = BlockPool(1, (1, 4, 4), mx.float32, block_size=8, blocks=blocks)
    held = pool.allocate(-(-positions // 8))
    kv = mx.arange(positions * 4, dtype=mx.float32).reshape(positions, 1, 4)
    pool.write(held, [(kv, -kv)], positions)
    return pool, held, kv


def per_token_gated_delta_ops():
    """mlx_vlm's per-token implementation of the gated delta rule, whether or not a test routed it."""
    from mlx_vlm.models import gated_delta

    return getattr(gated_delta.gated_delta_ops, "vlmserve_routed", gated_delta.gated_delta_ops)


def stand_in_gated_delta_kernel(monkeypatch) -> list:
    """engine/ops/gated_delta_scan as on CUDA, on any backend: it serves every call, and its
    kernel's launch is stood in for by mlx_vlm's per-token ops (the same rule). Returns the list
    each launch appends its (rows, positions) to."""
    from vlmserve.engine.ops import gated_delta_scan

    launched = []

    def launch(q, k, v, g, beta, state):
        launched.append(q.shape[:2])
        return per_token_gated_delta_ops()(q, k, v, g, beta, state)

    monkeypatch.setattr(gated_delta_scan, "serves", lambda q, *_: q.shape[1] > 0)
    monkeypatch.setattr(gated_delta_scan, "_launch", launch)
    return launched
