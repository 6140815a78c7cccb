"""Reference outputs from mlx_vlm.generate, computed on the server's own worker thread."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from PIL import Image

from vlmserve.protocol import ChatMessage, ImageRef


@lru_cache(maxsize=None)
def _mlx_vlm_processor(model_path: str):
    from mlx_vlm.utils import load_processor

    return load_processor(Path(model_path))


def rendered_prompt(server, text: str, n_images: int) -> str:
    parts = [("image", ImageRef("x", "x")) for _ in range(n_images)] + [("text", text)]
    return server.state.preprocessor.render([ChatMessage("user", parts)])


def mlx_vlm_text(server, text: str, image_paths: list[Path], max_tokens: int) -> str:
    """Greedy text from mlx_vlm.generate on the same model object, prompt and images."""
    import mlx_vlm

    prompt = rendered_prompt(server, text, len(image_paths))
    images = [Image.open(p).convert("RGB") for p in image_paths]
    processor = _mlx_vlm_processor(str(server.engine.model_path))
    model = server.engine.scheduler.vlm.model

    def run():
        result = mlx_vlm.generate(model, processor, prompt, image=images or None, max_tokens=max_tokens,
                                  temperature=0.0, verbose=False)
        return result.text

    return server.on_worker(run)
