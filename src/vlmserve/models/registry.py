"""model_type -> the family's adapters. Any model mlx-vlm loads gets the generic ones."""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from vlmserve.models.base import ModelAdapter, ProcessorAdapter

# model_type -> (processor adapter, model adapter), as "module:attribute" (None: the generic
# one), imported on use so the CPU side never imports a family's device code.
_FAST_PATHS: dict[str, tuple[str | None, str | None]] = {
    "gemma3": (None, "vlmserve.models.gemma3.adapter:Gemma3Model"),
    "internvl_chat": ("vlmserve.models.internvl_chat.processing:InternVLProcessing", None),
    "kimi_vl": ("vlmserve.models.kimi_vl.processing:KimiVLProcessing", None),
    "llava_next": ("vlmserve.models.llava_next.processing:LlavaNextProcessing", None),
    "mistral3": (None, "vlmserve.models.mistral3.adapter:Mistral3Model"),
    "mistral_large3": (None, "vlmserve.models.pixtral.adapter:PixtralModel"),
    "pixtral": (None, "vlmserve.models.pixtral.adapter:PixtralModel"),
    "qwen3_vl": (None, "vlmserve.models.qwen3_vl.adapter:Qwen3VLModel"),
    "qwen3_5": (None, "vlmserve.models.qwen3_vl.adapter:Qwen3VLModel"),  # Qwen3-VL's vision tower
    "qwen3_5_moe": (None, "vlmserve.models.qwen3_vl.adapter:Qwen3VLModel"),  # likewise
    "qwen2_vl": (
        "vlmserve.models.qwen2_vl.processing:QwenVLProcessing",
        "vlmserve.models.qwen2_vl.adapter:QwenVLModel",
    ),
    "qwen2_5_vl": (
        "vlmserve.models.qwen2_vl.processing:QwenVLProcessing",
        "vlmserve.models.qwen2_vl.adapter:QwenVLModel",
    ),
}
_GENERIC_MODEL = "vlmserve.models.generic:GenericModel"


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def processor_adapter(model_type: str) -> ProcessorAdapter:
    target = _FAST_PATHS.get(model_type, (None, None))[0]
    return _resolve(target)() if target else ProcessorAdapter()


def model_adapter_class(model_type: str) -> type:
    return _resolve(_FAST_PATHS.get(model_type, (None, None))[1] or _GENERIC_MODEL)


class UnsupportedModel(ValueError):
    """The checkpoint is not a model this server can load; the message names why."""


def model_type_of(model_path: Path) -> str:
    """The checkpoint's model_type as mlx-vlm resolves it; UnsupportedModel names what is wrong.
    Reads files only (no weights), so a server refuses such a model before loading anything."""
    from mlx_vlm.utils import get_model_type

    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise UnsupportedModel(f"{model_path} has no config.json: not a model checkpoint")
    config = json.loads(config_file.read_text())
    model_type = get_model_type(config)
    if model_type is None:
        raise UnsupportedModel(f"{config_file} names no model_type")
    if model_type not in _FAST_PATHS and importlib.util.find_spec(f"mlx_vlm.models.{model_type}") is None:
        import mlx_vlm

        raise UnsupportedModel(
            f"model_type {config.get('model_type')!r} ({model_path}) is not a model mlx-vlm "
            f"{mlx_vlm.__version__} can load"
        )
    return model_type


def load_model_adapter(
    model_path: Path,
    model_type: str,
    fallback_eos: tuple[int, ...] = (),
    before_first_forward: Callable[[], object] | None = None,
) -> ModelAdapter:
    """Load the model at `model_path` (on the MLX worker thread) behind its family's adapter;
    `model_type` as `model_type_of` resolved it. `before_first_forward` runs once its weights
    are read, before the load runs the model."""
    return model_adapter_class(model_type)(model_path, fallback_eos, before_first_forward)
