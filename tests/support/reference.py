"""Reference outputs from mlx_vlm.generate, computed on the server's own worker thread."""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path

from vlmserve.inputs.media import MediaPolicy, decode_image
from vlmserve.protocol import ChatMessage, ChatRequest, ImageRef, SamplingParams


class _WithoutPadding:
    """mlx_vlm.prepare_inputs passes `padding=` to the processor, and LlavaProcessor forwards
    it to the image processor, which transformers 5 rejects (real checkpoints too). One
    prompt needs no padding, so drop it; everything else goes to the real processor."""

    def __init__(self, processor):
        self._processor = processor

    def __call__(self, *args, padding=None, **kwargs):
        return self._processor(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._processor, name)


@cache
def _mlx_vlm_processor(model_path: str):
    from mlx_vlm.utils import load_processor

    return _WithoutPadding(load_processor(Path(model_path)))


def rendered_prompt(server, text: str, n_images: int) -> str:
    parts = [("image", ImageRef("x", "x")) for _ in range(n_images)] + [("text", text)]
    return server.state.preprocessor.render(ChatRequest([ChatMessage("user", parts)], SamplingParams()))


def mlx_vlm_text(server, text: str, image_paths: list[Path], max_tokens: int) -> str:
    """Greedy text from mlx_vlm.generate on the same model object, prompt and images."""
    return mlx_vlm_generate(server, rendered_prompt(server, text, len(image_paths)), image_paths, max_tokens)


def mlx_vlm_chat_text(server, messages: list[ChatMessage], image_paths: list[Path], max_tokens: int) -> str:
    """mlx_vlm.generate on the server's rendering of a whole chat (images in message order)."""
    return mlx_vlm_generate(
        server, server.state.preprocessor.render(ChatRequest(messages, SamplingParams())), image_paths, max_tokens
    )


def mlx_vlm_generate(server, prompt: str, image_paths: list[Path], max_tokens: int) -> str:
    import mlx_vlm

    # The server's own decoder (alpha flattened on white, EXIF-oriented): same pixels in both runs.
    images = [decode_image(Path(p).read_bytes(), MediaPolicy()) for p in image_paths]
    processor = _mlx_vlm_processor(str(server.engine.model_path))
    model = server.engine.core.model.model

    def run():
        with own_caches(model.language_model):
            result = mlx_vlm.generate(
                model, processor, prompt, image=images or None, max_tokens=max_tokens, temperature=0.0, verbose=False
            )
        return result.text

    return server.on_worker(run)


@contextlib.contextmanager
def own_caches(language_model):
    """The language model's own caches (its class's make_cache), not those the engine swapped in
    (kv_caches.plain_for_windows): the reference runs mlx-vlm's path as it ships."""
    swapped = vars(language_model).get("make_cache")
    if swapped is None:
        yield
        return
    del language_model.make_cache
    try:
        yield
    finally:
        language_model.make_cache = swapped
