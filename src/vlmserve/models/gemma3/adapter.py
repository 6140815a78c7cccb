"""Gemma 3: the generic adapter, with its sliding-window layers on plain caches.

mlx_vlm's Gemma 3 forward builds one mask of the window from the first layer's cache
(`make_mask(..., window_size=sliding_window)`) and hands it to every sliding layer, and the
full causal mask to the global ones. With plain caches in place of the rotating ones, each
query attends to the same keys, and the model takes the paged KV pool, the compiled decode
step, the KV budget with preemption, the pieces forward and prefix reuse.
"""

from __future__ import annotations

from vlmserve.models.generic import GenericModel


class Gemma3Model(GenericModel):
    windows_in_masks = True
