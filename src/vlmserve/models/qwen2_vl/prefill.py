"""A Qwen2-VL / Qwen2.5-VL prompt forward in fewer primitives (CUDA).

A prompt piece's forward on CUDA is bound by the host's cost per primitive, as a decode step
is: a chat's follow-up turn (~500 new tokens after ~1,100 cached, 2B model, H100) spent ~6 ms
building mlx_vlm's graph and ~15 ms launching it, while the device was done ~3 ms after the
last launch. Each of mlx_vlm's layers makes ~80 primitives, most of them reshapes,
transposes, broadcasts and the rotary embedding's slices and products. Here a layer reads the
same weights in the same order and takes:
  - the fused q/k/v matmul (fused_projections), split into heads and rotated by the decode
    step's kernel (decode.py), which rounds each product and sum as mlx_vlm's ops round them;
  - the cache's own update (the request's KVCache, or the ragged view over several);
  - one attention kernel (engine/ops/prefill_attention) over the cache as it lies, which
    reads each row's offset and padding as data and writes its output laid out for o_proj,
    where the cache is one it knows (a request's own, the ragged view over several, a
    left-padded group); else the composed attention that mlx_vlm's call reaches on CUDA
    (engine/ops/composed_attention), with the mask laid out for grouped heads once per forward;
  - the model's o_proj, norms and MLP, each residual add with the norm after it in one kernel
    and the SwiGLU reading the fused gate/up output in place (engine/ops/residual_norm,
    gated_activation).
With the composed attention in float32 (where the norm and SwiGLU kernels do not serve), bit
for bit what mlx_vlm's forward computes; with the kernels, the same to bf16 rounding
(tests/integration/models/qwen2_vl/test_prefill.py). Off CUDA
(`kernels=False`) the rotation and attention are mlx_vlm's own calls, for comparison.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.models.base import create_attention_mask

from vlmserve.engine.ops import (
    composed_attention,
    cuda_kernels,
    few_row_linear,
    few_row_matmul,
    prefill_attention,
    residual_norm,
)
from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache
from vlmserve.models.qwen2_vl import decode as qwen_decode
from vlmserve.models.ragged_cache import RaggedLayerCache

_FEW_ROWS = 4 * few_row_matmul.MAX_ROWS  # past this, every position's logits: MLX's matmul


def applies(kwargs: dict) -> bool:
    """Whether a prompt forward with these extra inputs takes `forward` (CUDA, M-RoPE positions only)."""
    return set(kwargs) == {"position_ids"} and cuda_kernels.enabled()


def cache_rows(cache, batch: int) -> tuple[mx.array, mx.array] | None:
    """Where each row's new positions start in `cache` and its first key a query may see, as the
    attention kernel takes them ((B,) int32 each), before the forward writes; None for a cache
    it does not know."""
    if isinstance(cache, (RaggedLayerCache, PagedPiecesCache)):
        return cache.offset, mx.zeros((batch,), dtype=mx.int32)
    if type(cache) is vlm_cache.KVCache:
        return mx.full((batch,), cache.offset, dtype=mx.int32), mx.zeros((batch,), dtype=mx.int32)
    if type(cache) is vlm_cache.BatchKVCache:  # left-padded rows: a row's padding is never seen
        return mx.full((batch,), cache._idx, dtype=mx.int32), cache.left_padding.astype(mx.int32)
    return None


def forward(
    language_model: nn.Module, embeds: mx.array, position_ids: mx.array, caches: list, kernels: bool = True
) -> mx.array:
    """embeds (B, L, D) and their M-RoPE position_ids (3, B, L) through every layer, into `caches`
    (one per layer, as mlx_vlm's forward takes them); returns the final norm's output (B, L, D),
    lazily (`logits` makes logits of it, of every position or of a few)."""
    model = language_model.model
    h = embeds
    batch, length, _ = h.shape
    attn0 = model.layers[0].self_attn
    cos, sin = attn0.rotary_emb(h, position_ids)
    fused = kernels and prefill_attention.serves(h.dtype, attn0.n_heads, attn0.n_kv_heads, attn0.head_dim)
    rows = cache_rows(caches[0], batch) if fused else None
    mask = None
    if rows is None:
        mask = create_attention_mask(h, caches)
        if kernels:
            mask = composed_attention.grouped_mask(mask, attn0.n_heads, attn0.n_kv_heads)
    normed = model.layers[0].input_layernorm(h)
    for layer, cache, next_norm in zip(model.layers, caches, qwen_decode.norms_after(model)):
        attn = layer.self_attn
        qkv = qwen_decode.qkv(attn, normed, False)
        q, k, v = qwen_decode.rope_split(qkv, cos, sin, attn.n_heads, attn.n_kv_heads, kernels)
        keys, values = cache.update_and_fetch(k, v)
        if rows is not None:  # already laid out as (B, L, Hq * D)
            out = prefill_attention.attend(q, keys, values, attn.scale, *rows)
        else:
            layer_mask = mask
            if isinstance(mask, mx.array) and mask.shape[-1] != keys.shape[-2]:
                layer_mask = mask[..., : keys.shape[-2]]  # as mlx_vlm's attention trims it
            if kernels:
                out = composed_attention.composed(q, keys, values, attn.scale, layer_mask)
            else:  # the attention function the model's module calls (rebound or not), as its layer would
                sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
                out = sdpa(q, keys, values, cache, scale=attn.scale, mask=layer_mask)
            out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        # Its many rows take MLX's matmuls; the residual norms and the SwiGLU the kernels.
        h, normed = residual_norm.add_rms_norm(h, attn.o_proj(out), layer.post_attention_layernorm, kernels)
        mlp_out = qwen_decode.mlp(layer.mlp, normed, False, kernels)
        h, normed = residual_norm.add_rms_norm(h, mlp_out, next_norm, kernels)
    return normed


def logits(language_model: nn.Module, h: mx.array, kernels: bool = True) -> mx.array:
    """The language model's output layer over `forward`'s output. With `kernels`, a few positions
    (each prompt's last) take the decode step's few-row kernels where they serve: MLX's quantized
    matmul over a 150k-wide output layer at a handful of rows is several times slower."""
    few = kernels and math.prod(h.shape[:-1]) <= _FEW_ROWS
    if language_model.args.tie_word_embeddings:
        embedding = language_model.model.embed_tokens
        return few_row_linear.tied_logits(embedding, h) if few else embedding.as_linear(h)
    return few_row_linear.linear(language_model.lm_head, h) if few else language_model.lm_head(h)
