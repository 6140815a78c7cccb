"""Pixtral's vision tower (Pixtral, Mistral 3) without its attention mask: one run per image.

mlx_vlm's tower puts every image's patches in one sequence and keeps them apart with an
additive block-diagonal mask, all zeros for a single image. On CUDA a masked attention call
goes to cuDNN, which builds a plan the first time it meets a sequence length (each image size,
and each combination of sizes; 42-108 ms on an H100, while every stream waits), where an
unmasked one takes vlmserve's plan-free route (engine/ops/tower_attention.py). A patch only
attends to its own image's patches and every other step of the tower is per patch, so here the
tower runs once per image with no mask, and the runs' outputs (the last layer's and every
layer's hidden states) are joined in image order: the features mlx_vlm's masked call computes,
to its attention's rounding.

The swap is per module instance (its class is replaced by a subclass), so only the model the
server loaded changes; the mask function is rebound only while the swapped tower runs (on the
MLX thread, the only one that runs towers).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

_VISION_MODULE = "mlx_vlm.models.pixtral.vision"


@contextlib.contextmanager
def _unmasked(module) -> Iterator[None]:
    """mlx_vlm's block mask as None while a single image's run is in progress."""
    block_mask = module.generate_block_attention_mask

    def one_block(patch_counts, tensor):
        return None if len(patch_counts) == 1 else block_mask(patch_counts, tensor)

    module.generate_block_attention_mask = one_block
    try:
        yield
    finally:
        module.generate_block_attention_mask = block_mask


def _make_class(base: type) -> type:
    module = sys.modules[base.__module__]

    def __call__(self, x: mx.array, output_hidden_states: bool | None = None, image_sizes=None):
        if image_sizes is not None and len(image_sizes) != x.shape[0]:  # mlx_vlm's call says why
            return base.__call__(self, x, output_hidden_states, image_sizes=image_sizes)
        runs = []
        with _unmasked(module):
            for i in range(x.shape[0]):
                sizes = None if image_sizes is None else image_sizes[i : i + 1]
                runs.append(base.__call__(self, x[i : i + 1], output_hidden_states, image_sizes=sizes))
        if len(runs) == 1:
            return runs[0]
        last = mx.concatenate([out for out, _ in runs], axis=1)
        if runs[0][1] is None:
            return last, None
        return last, tuple(mx.concatenate(layer, axis=1) for layer in zip(*(states for _, states in runs)))

    return type(f"PerImage{base.__name__}", (base,), {"__call__": __call__})


_CLASSES: dict[type, type] = {}


def install(tower: nn.Module) -> bool:
    """Swap a Pixtral vision tower's call for the per-image one; False for other towers."""
    base = type(tower)
    if installed(tower):
        return False
    if base.__name__ != "VisionModel" or base.__module__ != _VISION_MODULE:
        return False
    if not hasattr(sys.modules[base.__module__], "generate_block_attention_mask"):
        return False
    if base not in _CLASSES:
        _CLASSES[base] = _make_class(base)
    tower.__class__ = _CLASSES[base]
    return True


def installed(tower: nn.Module) -> bool:
    return type(tower) in _CLASSES.values()


def uninstall(tower: nn.Module) -> bool:
    """Give the tower back mlx_vlm's own call (for comparisons)."""
    if not installed(tower):
        return False
    tower.__class__ = type(tower).__mro__[1]
    return True
