"""Tiny checkpoints of every family scripts/make_fixtures.py builds, in each format users download.

The committed fixtures (fixtures/models/) serve float32 where they exist; every other family and
format is built on first use into one directory per test run: make_fixtures' own builder, then
mlx-vlm's convert for the 4-bit variant (bfloat16 scales, as mlx-community publishes them).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

from support.helpers import MODELS, ROOT, on_own_thread

FORMATS = ("float32", "4bit")
BIG = {"included": False}  # set by `pytest --big-families` (tests/conftest.py)
_lock = threading.Lock()


@cache
def make_fixtures():
    """scripts/make_fixtures.py as a module."""
    path = ROOT / "scripts" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_fixtures"] = module
    spec.loader.exec_module(module)
    return module


def families() -> tuple[str, ...]:
    """The families with tiny checkpoints (make_fixtures.NOT_TINY names the others, and why), and
    under `--big-families` the big ones make_fixtures builds too."""
    return make_fixtures().tiny_family_names(big=BIG["included"])


def checkpoint(name: str, fmt: str, cache_dir: Path) -> Path:
    """The checkpoint of family `name` in format `fmt`, built into cache_dir once."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    mf = make_fixtures()
    with _lock:  # building is MLX work: on a thread of its own (the thread guard's rule)
        src = MODELS / name
        if not src.is_dir():
            src = cache_dir / name
            if not src.is_dir():
                on_own_thread(lambda: mf.write_checkpoint(name, cache_dir))
        if fmt == "float32":
            return src
        dst = cache_dir / f"{name}{mf.QUANTIZED_SUFFIX}"
        if not dst.is_dir():
            on_own_thread(lambda: mf.write_quantized(src, dst))
        return dst


def image_prompt(path: Path, sizes=((80, 64),)):
    """A preprocessed chat request with random images of these (width, height) sizes and a question."""
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.preprocess import Preprocessor
    from vlmserve.models.processor import load_processor
    from vlmserve.models.registry import model_type_of
    from vlmserve.protocol import ChatMessage, ChatRequest, SamplingParams

    pre = Preprocessor(load_processor(path), 4096, ServerConfig(), model_type=model_type_of(path))
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    parts = [("image", None) for _ in images] + [("text", "What is it?")]
    try:
        return pre.encode(pre.render(ChatRequest([ChatMessage("user", parts)], SamplingParams())), images)
    finally:
        pre.close()


def session_checkpoint(name: str, fmt: str, tmp_path_factory) -> Path:
    """`checkpoint` built once per test session, under its base temporary directory."""
    cache_dir = tmp_path_factory.getbasetemp() / "families"
    cache_dir.mkdir(exist_ok=True)
    return checkpoint(name, fmt, cache_dir)


def adapter_loader(name: str, fmt: str, tmp_path_factory):
    """A loader of the family's (ModelAdapter, TextCodec), for the worker thread to call."""
    path = session_checkpoint(name, fmt, tmp_path_factory)

    def load():
        from vlmserve.engine.runner.tokenizer import TextCodec
        from vlmserve.models.registry import load_model_adapter, model_type_of

        codec = TextCodec(path)
        return load_model_adapter(path, model_type_of(path), codec.eos_token_ids), codec

    return load
