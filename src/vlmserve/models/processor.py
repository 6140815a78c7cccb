"""The model's processor (chat template, image processor, tokenizer) for the CPU pool.

mlx_vlm's processors (which it registers with transformers' AutoProcessor, and which work
without PyTorch) end their __call__ with `to_mlx(...)`, building mx.arrays on whatever
thread calls them. MLX arrays must only be made on the worker thread, so the processing
modules' `to_mlx` is swapped for a NumPy equivalent: preprocessing hands NumPy to the
worker, and mlx_vlm's own `prepare_inputs` still converts NumPy to mx.array itself.
Loading and calling the processor involves no MLX work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _to_numpy(data: dict) -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, list):
            try:
                value = np.array(value)
            except (ValueError, TypeError):
                pass
        out[key] = value
    return out


def _numpy_outputs(processor) -> None:
    for obj in (processor, getattr(processor, "image_processor", None)):
        module = sys.modules.get(type(obj).__module__) if obj is not None else None
        if module is not None and hasattr(module, "to_mlx"):
            module.to_mlx = _to_numpy


def load_processor(model_path: Path):
    from mlx_vlm.utils import get_model_and_args, load_config
    from mlx_vlm.utils import load_processor as vlm_load_processor

    # Importing the family's module registers its processor with AutoProcessor.
    get_model_and_args(load_config(model_path), model_path)
    processor = vlm_load_processor(model_path, add_detokenizer=False)
    _numpy_outputs(processor)
    return processor


def plain_prompt(processor, messages: list[dict]) -> str:
    """The prompt of a checkpoint without a chat template, as mlx-vlm renders it: an image token
    per image, then the text; "Role: text" lines for a longer chat."""
    from mlx_vlm.prompt_utils import get_chat_template

    return get_chat_template(processor, messages, add_generation_prompt=True)
