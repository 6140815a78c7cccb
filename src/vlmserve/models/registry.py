"""model_type -> the family's adapters. Any model mlx-vlm loads gets the generic ones."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from vlmserve.models.base import ModelAdapter, ProcessorAdapter

# model_type -> (processor adapter, model adapter), as "module:attribute", imported on use so
# the CPU side never imports a family's device code.
_FAST_PATHS: dict[str, tuple[str, str]] = {
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
    entry = _FAST_PATHS.get(model_type)
    return _resolve(entry[0])() if entry else ProcessorAdapter()


def model_adapter_class(model_type: str) -> type:
    entry = _FAST_PATHS.get(model_type)
    return _resolve(entry[1] if entry else _GENERIC_MODEL)


def load_model_adapter(model_path: Path, fallback_eos: tuple[int, ...] = ()) -> ModelAdapter:
    """Load the model at `model_path` (on the MLX worker thread) behind its family's adapter."""
    model_type = json.loads((model_path / "config.json").read_text()).get("model_type", "")
    return model_adapter_class(model_type)(model_path, fallback_eos)
