"""A Qwen2-VL / Qwen2.5-VL decode step over the paged KV pool in few kernels (CUDA).

On CUDA a compiled decode step is bound by the host's cost per primitive, not by the
weights' bandwidth. Through mlx_vlm's modules each layer's attention is ~35 primitives:
reshapes and transposes of q/k/v, the rotary embedding's expand/slice/rotate ops, the
cache's index broadcasts, the mask, the attention and the transpose back. Here the layer
reads the same weights in the same order and takes:
  - the fused q/k/v matmul (fused_projections);
  - one kernel that splits q/k/v into heads and rotates q and k, with each product and the
    sum rounded to the activation dtype as mlx_vlm's eager ops round them;
  - the cache write (engine/ops/paged_layer_cache.py) and the one-query attention kernel
    (engine/ops/decode_attention.py), whose output is already laid out for o_proj;
  - each residual add with the RMS norm after it in one kernel, and the MLP's SwiGLU reading the
    fused gate/up output in place (engine/ops/residual_norm.py, gated_activation.py; bf16/fp16).
The cos/sin tables come from the model's own rotary module, once per step; the norms' weights,
the MLP's matmuls and the logits are the model's modules. Off CUDA, and for any other model,
mlx_vlm's forward runs.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.mlp import SwiGLUMLP, swiglu
from mlx_vlm.models.rope_utils import apply_multimodal_rotary_pos_emb

from vlmserve.engine.ops import cuda_kernels, decode_attention, few_row_linear, gated_activation, residual_norm
from vlmserve.engine.ops.fused_projections import FusedPart
from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache

# The language modules whose layers this step reproduces (their attention and decoder layer
# are the same code in both families).
_FAMILIES = {"mlx_vlm.models.qwen2_vl.language", "mlx_vlm.models.qwen2_5_vl.language"}

# qkv (B, L, (HQ + 2*HKV) * D), in rows of positions -> q (B, HQ, L, D), k and v (B, HKV, L, D); q and k rotated:
# x*cos + rotate_half(x)*sin, each product and the sum rounded to T (no fused multiply-add).
# cos, sin (B, L, D). One thread per element, one block per head of one position (blockDim.x == D).
_ROPE_SPLIT_SOURCE = """
    const size_t i = (size_t)blockIdx.x * D + threadIdx.x;
    constexpr int N = (HQ + 2 * HKV) * D;
    const size_t t = i / N;  // the position's row of qkv: b * L + l
    const size_t L = cos_t_shape[1], b = t / L, l = t % L;
    const int j = i % N, head = j / D, d = j % D;
    if (head >= HQ + HKV) { v[((b * HKV + head - HQ - HKV) * L + l) * D + d] = qkv[i]; return; }
    const float c = static_cast<float>(cos_t[t * D + d]), s = static_cast<float>(sin_t[t * D + d]);
    const float x = static_cast<float>(qkv[i]);
    const float other = d < D / 2 ? -static_cast<float>(qkv[i + D / 2]) : static_cast<float>(qkv[i - D / 2]);
    const float a = static_cast<float>(static_cast<T>(__fmul_rn(x, c)));
    const float r = static_cast<float>(static_cast<T>(__fmul_rn(other, s)));
    const T out = static_cast<T>(__fadd_rn(a, r));
    if (head < HQ) q[((b * HQ + head) * L + l) * D + d] = out; else k[((b * HKV + head - HQ) * L + l) * D + d] = out;
"""


def same_layers(language_model: nn.Module) -> bool:
    """Whether `forward` reproduces this language model's step: a Qwen2-VL / Qwen2.5-VL
    language model whose rotary embedding covers the whole head, chunked."""
    if type(language_model).__module__ not in _FAMILIES:
        return False
    attn = language_model.model.layers[0].self_attn
    rotary = attn.rotary_emb
    return rotary.dim == attn.head_dim and getattr(rotary, "style", None) == "chunked" and not rotary.fused_apply


def supports(language_model: nn.Module) -> bool:
    """Whether the server takes `forward` for this model's steps (on CUDA): the same layers, and
    heads the attention kernel serves."""
    if not same_layers(language_model):
        return False
    attn = language_model.model.layers[0].self_attn
    return decode_attention.serves_heads(attn.n_heads, attn.n_kv_heads, attn.head_dim)


def applies(caches: list) -> bool:
    """Per step (with M-RoPE positions given): kernels on, and the paged cache."""
    return isinstance(caches[0], PagedLayerCache) and cuda_kernels.enabled()


def _linear(layer: nn.Module, x: mx.array, kernels: bool) -> mx.array:
    return few_row_linear.linear(layer, x) if kernels else layer(x)


def _fused(part: nn.Module, size: int) -> nn.Module | None:
    """The fused layer behind a group's first projection (fused_projections), if it has `size` members."""
    return part._group.fused if isinstance(part, FusedPart) and part._group.size == size else None


def qkv(attn: nn.Module, x: mx.array, kernels: bool) -> mx.array:
    """The attention block's q, k and v projections of x, side by side (one matmul when fused)."""
    fused = _fused(attn.q_proj, 3)
    if fused is not None:
        return _linear(fused, x, kernels)
    return mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)


def mlp(module: nn.Module, x: mx.array, kernels: bool, in_place: bool) -> mx.array:
    """The model's SwiGLU MLP: down(swiglu(gate(x), up(x))), its gate/up as one matmul (its
    matmuls the few-row kernels with `kernels`; the halves read in place by one launch with
    `in_place`)."""
    fused = _fused(module.gate_proj, 2)
    if fused is None or type(module) is not SwiGLUMLP:
        return module(x)
    gate_up, split = _linear(fused, x, kernels), module.gate_proj._stop
    if in_place and gated_activation.serves(gate_up, split):
        return _linear(module.down_proj, gated_activation.swiglu_halves(gate_up, split), kernels)
    gate, up = mx.split(gate_up, [split], axis=-1)
    return _linear(module.down_proj, swiglu(gate, up), kernels)


def norms_after(model: nn.Module) -> list[nn.Module]:
    """The norm after each layer's MLP: the next layer's input norm, the model's after the last.
    Each half of a layer ends with a residual add and the norm of what follows, one launch with
    the kernels (residual_norm.add_rms_norm)."""
    return [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]


def rope_split(
    qkv: mx.array, cos: mx.array, sin: mx.array, q_heads: int, kv_heads: int, kernel: bool, kv_rows: bool = False
) -> tuple[mx.array, mx.array, mx.array]:
    """qkv (B, L, (Hq + 2 Hkv) D) (or (B, (Hq + 2 Hkv) D) when L is 1); cos, sin (B, L, D) -> rotated
    q (B, Hq, L, D), k, v (B, Hkv, L, D). With `kv_rows` (L of 1) k and v come as (B, Hkv, D),
    the rows the paged cache writes (from the kernel, the same memory: no view to make)."""
    batch, length = cos.shape[:2]
    dim = cos.shape[-1]
    if kv_rows and length != 1:
        raise ValueError("kv_rows takes one position per row")
    if not kernel:  # mlx_vlm's own ops
        q, k, v = mx.split(qkv, [q_heads * dim, (q_heads + kv_heads) * dim], axis=-1)
        q, k, v = (t.reshape(batch, length, -1, dim).transpose(0, 2, 1, 3) for t in (q, k, v))
        q, k = apply_multimodal_rotary_pos_emb(q, k, cos, sin, style="chunked", unsqueeze_dim=1)
        return (q, k[:, :, 0, :], v[:, :, 0, :]) if kv_rows else (q, k, v)
    run = cuda_kernels.kernel(
        "vlmserve_rope_split", ("qkv", "cos_t", "sin_t"), _ROPE_SPLIT_SOURCE, output_names=("q", "k", "v")
    )
    kv_shape = (batch, kv_heads, dim) if kv_rows else (batch, kv_heads, length, dim)
    return tuple(
        run(
            inputs=[qkv, cos, sin],
            template=[("T", qkv.dtype), ("D", dim), ("HQ", q_heads), ("HKV", kv_heads)],
            grid=(qkv.size, 1, 1),
            threadgroup=(dim, 1, 1),
            output_shapes=[(batch, q_heads, length, dim), kv_shape, kv_shape],
            output_dtypes=[qkv.dtype] * 3,
        )
    )


def forward(
    language_model: nn.Module,
    tokens: mx.array,
    caches: list[PagedLayerCache],
    position_ids: mx.array,
    kernels: bool = True,
) -> mx.array:
    """One token per row: tokens (B,), position_ids (3, B, 1) -> logits (B, V); caches updated.

    The same computation as mlx_vlm's LanguageModel call for this step. `kernels=False` runs
    the composed ops (mlx_vlm's rotation and attention), for comparison on any backend."""
    model = language_model.model
    h = model.embed_tokens(tokens[:, None])
    cos, sin = model.layers[0].self_attn.rotary_emb(h, position_ids)
    lengths = caches[0].offset + 1  # each row attends to its cache and the new token
    batch = tokens.shape[0]
    normed = model.layers[0].input_layernorm(h)
    for layer, cache, next_norm in zip(model.layers, caches, norms_after(model)):
        attn = layer.self_attn
        q, k, v = rope_split(qkv(attn, normed, kernels), cos, sin, attn.n_heads, attn.n_kv_heads, kernels, kernels)
        if kernels:
            cache.write_token(k, v)
            out = decode_attention.attend(
                q, cache, lengths, attn.scale, out_shape=(batch, 1, attn.n_heads * attn.head_dim)
            )
        else:
            keys, values = cache.update_and_fetch(k, v)
            # The attention function the model's module calls (rebound or not), as its layer would.
            sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
            out = sdpa(q, keys, values, cache, scale=attn.scale, mask=cache.make_mask(1))
            out = out.transpose(0, 2, 1, 3).reshape(batch, 1, -1)
        out = _linear(attn.o_proj, out, kernels)
        h, normed = residual_norm.add_rms_norm(h, out, layer.post_attention_layernorm, kernels)
        h, normed = residual_norm.add_rms_norm(h, mlp(layer.mlp, normed, kernels, kernels), next_norm, kernels)
    h = normed
    if not language_model.args.tie_word_embeddings:
        logits = _linear(language_model.lm_head, h, kernels)
    elif kernels:
        logits = few_row_linear.tied_logits(model.embed_tokens, h)
    else:
        logits = model.embed_tokens.as_linear(h)
    return logits[:, -1, :]
