"""Load a VLM through mlx_vlm and adapt it to per-request state and batched decode.

Runs only on the MLX worker thread. The adapter keeps what mlx_vlm keeps on the shared
model object between calls (Qwen2-VL's M-RoPE `_rope_deltas` / `_position_ids`) with each
request instead, by always passing explicit position ids to the language model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.utils import load_model

from vlmserve.engine.ops import cuda_kernels, decode_attention, fused_projections, rope_rotation
from vlmserve.models.qwen2_vl import decode as qwen_decode
from vlmserve.models.qwen2_vl import embedding as qwen_embedding
from vlmserve.models.qwen2_vl import packed_pixels, vision_attention
from vlmserve.protocol import ModelInfo, PreparedRequest

log = logging.getLogger(__name__)

# Embedding outputs that only make sense for a single, unpadded row.
_PER_ROW_ONLY = {"attention_mask_4d", "labels", "attention_mask"}

# Families whose vision tower takes the patches of many images in one call
# (`vision_tower(pixel_values, image_grid_thw)`, attention split per image) and whose
# get_input_embeddings accepts the tower's output as `cached_image_features`.
_GRID_TOWERS = {"qwen2_vl", "qwen2_5_vl"}


# mx.array(ndarray) holds the GIL for its whole copy. The event loop gives the GIL up at every
# socket write and waits out whatever the worker is in when it wants it back: with one copy per
# request's pixels (2.4 MB for W1), 64 streams' writes each waited out a copy (loop stalls of
# 20-40 ms on the H100). In pieces, the worst wait is one piece.
_COPY_PIECE_BYTES = 256 * 1024


def host_to_mx(v: np.ndarray) -> mx.array:
    """mx.array(v), the same array, copied in pieces of at most _COPY_PIECE_BYTES."""
    if v.nbytes <= _COPY_PIECE_BYTES or v.ndim == 0:
        return mx.array(v)
    flat = np.ascontiguousarray(v).reshape(-1)
    step = max(1, _COPY_PIECE_BYTES // flat.itemsize)
    return mx.concatenate([mx.array(flat[i : i + step]) for i in range(0, flat.size, step)]).reshape(v.shape)


def image_grids(prepared: PreparedRequest) -> np.ndarray:
    """The (t, h, w) patch grid of each of a request's images, (N, 3); none outside Qwen-VL grid towers."""
    grids = prepared.model_inputs.get("image_grid_thw")
    return np.zeros((0, 3), dtype=np.int64) if grids is None else np.asarray(grids).reshape(-1, 3)


def _device_inputs(prepared: PreparedRequest) -> dict[str, mx.array]:
    host = prepared.model_inputs
    inputs = {
        k: host_to_mx(v).view(mx.bfloat16) if k in prepared.bfloat16_inputs else host_to_mx(v)
        for k, v in host.items()
        if k != "pixel_layout"
    }
    if "pixel_bytes" in inputs:  # packed Qwen-VL frames: the patches are made here, on the device
        inputs["pixel_values"] = packed_pixels.expand(
            inputs.pop("pixel_bytes"), inputs.pop("pixel_table"), image_grids(prepared), host["pixel_layout"]
        )
    return inputs


def resolve_model_path(model: str) -> Path:
    """A local directory, or a Hugging Face repo id fetched (or found in the cache) via huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model path not found: {model}")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]
    return Path(snapshot_download(model, allow_patterns=patterns))


def _context_length(config: dict) -> int:
    text = config.get("text_config") or {}
    for source in (text, config):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
            if isinstance(source.get(key), int):
                return int(source[key])
    return 4096


def _eos_ids(path: Path, config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    candidates = [config.get("eos_token_id"), (config.get("text_config") or {}).get("eos_token_id")]
    gen = path / "generation_config.json"
    if gen.exists():
        candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))


@dataclass
class PromptState:
    """One request's prompt on the device: embeddings, positions and its own KV cache."""

    input_ids: mx.array  # (1, L)
    embeds: mx.array  # (1, L, D)
    position_ids: mx.array | None  # (3, 1, L) for M-RoPE families, else None
    rope_delta: int
    cache: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)


class VLM:
    """The loaded model plus the calls the scheduler needs, all on the worker thread."""

    def __init__(self, model_path: Path, fallback_eos: tuple[int, ...] = ()):
        self.path = model_path
        self.model = load_model(model_path, lazy=False)
        # load_model(lazy=False) evaluates parameters; evaluate again to be sure any buffer too.
        mx.eval(self.model.parameters())
        self.config = json.loads((model_path / "config.json").read_text())
        self.language_model = self.model.language_model
        # M-RoPE families (Qwen2-VL...) take explicit (3, B, L) positions; decode passes them per row.
        self.uses_mrope = hasattr(self.language_model, "get_rope_index")
        pixel_dtype = None
        if self.config.get("model_type") in _GRID_TOWERS:
            vision_attention.install(self.model.vision_tower)
            # get_input_embeddings casts pixels to the tower's dtype first: preprocessing ships them cast
            dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
            pixel_dtype = {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype)
        fused_projections.install(self.language_model)
        rope_rotation.install()
        decode_attention.install()
        self.fast_decode = qwen_decode.supports(self.language_model)
        self._kv_layout = None
        eos = _eos_ids(model_path, self.config) or fallback_eos
        self.info = ModelInfo(
            path=str(model_path),
            model_type=self.config.get("model_type", "unknown"),
            context_length=_context_length(self.config),
            vocab_size=int(self.language_model.model.embed_tokens.weight.shape[0]),
            eos_token_ids=tuple(eos),
            image_token_id=getattr(self.model.config, "image_token_id", None)
            or getattr(self.model.config, "image_token_index", None),
            pixel_dtype=pixel_dtype,
        )

    # ---- prompt ---------------------------------------------------------------
    def stage_inputs(self, prepared: PreparedRequest) -> dict[str, mx.array]:
        """A request's arrays copied into MLX now, ahead of its embedding (`embed_prompts(staged=)`)."""
        return _device_inputs(prepared)

    def embed_prompts(
        self, prepared: list[PreparedRequest], staged: list[dict[str, mx.array] | None] | None = None
    ) -> list[PromptState]:
        """Embed several prompts. For Qwen-VL families all their images share one vision-tower call
        (one launch sequence instead of one per image), and image prompts are embedded from
        host-side indices (`qwen_embedding`), so the worker never waits on a device read here.
        `staged` holds `stage_inputs` results (or None) per request."""
        staged = staged or [None] * len(prepared)
        inputs = {id(p): s for p, s in zip(prepared, staged) if s is not None}
        with_images = [p for p in prepared if p.has_pixels]
        if not with_images or self.info.model_type not in _GRID_TOWERS:
            return [self.embed_prompt(p, inputs=inputs.get(id(p))) for p in prepared]
        tower = self.model.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        for p in with_images:  # one host->device copy per request not staged already
            if id(p) not in inputs:
                inputs[id(p)] = _device_inputs(p)
        pixels = mx.concatenate([inputs[id(p)]["pixel_values"] for p in with_images]).astype(dtype)
        grids = {id(p): image_grids(p) for p in with_images}
        features = self._tower(pixels, np.concatenate(list(grids.values())))
        # Start the tower now: the per-request embedding below is host work (M-RoPE positions),
        # done while the device runs the tower's last command buffers instead of before them.
        mx.async_eval(features)
        merge = self.model.config.vision_config.spatial_merge_size**2
        rows = np.cumsum([int(np.prod(g, axis=1).sum()) // merge for g in grids.values()])[:-1]
        per_request = dict(zip(grids, mx.split(features, rows.tolist())))
        return [
            self._embed_image_prompt(p, per_request[id(p)], grids[id(p)], inputs[id(p)])
            if id(p) in per_request
            else self.embed_prompt(p, inputs=inputs.get(id(p)))
            for p in prepared
        ]

    def _tower(self, pixels: mx.array, grid: np.ndarray) -> mx.array:
        """All images' features from one vision-tower call (Qwen-VL grid towers)."""
        if self.info.model_type == "qwen2_vl":
            return qwen_embedding.qwen2_vl_tower(self.model.vision_tower, pixels, grid)
        return self.model.vision_tower(pixels, mx.array(grid), output_hidden_states=False)

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Prompt tokens one image of this patch grid takes (Qwen-VL: merged patches)."""
        merge = getattr(self.model.config.vision_config, "spatial_merge_size", 1)
        return int(np.prod(grid_thw)) // (merge * merge)

    def warm_vision_plans(self, grid_thw: tuple[int, int, int], max_images: int) -> list[int]:
        """Run the tower at every power-of-two image count up to `max_images` of one image size,
        so cuDNN's attention plans for that size exist before traffic (vision_attention);
        returns the counts run (none where the tower's attention does not go to cuDNN)."""
        if self.info.model_type not in _GRID_TOWERS or not cuda_kernels.cudnn_enabled():
            return []
        vc = self.model.config.vision_config
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        counts = [1 << i for i in range(max(1, max_images).bit_length())]
        for n in counts:
            pixels = mx.zeros((n * int(np.prod(grid_thw)), width), dtype=dtype)
            mx.eval(self._tower(pixels, np.array([grid_thw] * n, dtype=np.int64)))
        return counts

    def _embed_image_prompt(
        self, prepared: PreparedRequest, features: mx.array, grid: np.ndarray, inputs: dict[str, mx.array]
    ) -> PromptState:
        ids = prepared.prompt_ids.astype(np.int32)
        cfg = self.language_model.config  # what mlx_vlm's get_rope_index reads
        found = qwen_embedding.mrope_positions(
            ids,
            grid,
            image_token=cfg.image_token_id,
            video_token=cfg.video_token_id,
            vision_start=cfg.vision_start_token_id,
            merge=cfg.vision_config.spatial_merge_size,
        )
        if found is None:  # a prompt outside the image path: mlx_vlm's own code, with these features
            return self.embed_prompt(prepared, features, inputs)
        positions, rope_delta = found
        input_ids = mx.array(ids)[None]
        embeds = self.language_model.model.embed_tokens(input_ids)
        return PromptState(
            input_ids=input_ids,
            embeds=qwen_embedding.merge_image_features(embeds, features, ids, self.model.config.image_token_id),
            position_ids=mx.array(positions)[:, None, :],
            rope_delta=rope_delta,
            cache=vlm_cache.make_prompt_cache(self.language_model),
        )

    def embed_prompt(
        self,
        prepared: PreparedRequest,
        image_features: mx.array | None = None,
        inputs: dict[str, mx.array] | None = None,
    ) -> PromptState:
        """NumPy -> mx on this thread (unless `inputs` already holds it), then vision encoder + token embeddings."""
        input_ids = mx.array(prepared.prompt_ids.astype(np.int32))[None]
        inputs = dict(inputs if inputs is not None else _device_inputs(prepared))
        pixel_values = inputs.pop("pixel_values", None)
        mask = mx.ones(input_ids.shape, dtype=mx.int32)
        if image_features is not None:
            inputs["cached_image_features"] = image_features
        out = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs)
        extra = {
            k: v
            for k, v in out.to_dict().items()
            if v is not None and k not in _PER_ROW_ONLY | {"inputs_embeds", "position_ids", "rope_deltas"}
        }
        if extra:
            raise NotImplementedError(f"{self.info.model_type}: embedding outputs {sorted(extra)} are not supported")
        rope_delta = 0
        if out.rope_deltas is not None:
            rope_delta = int(mx.array(out.rope_deltas).reshape(-1)[0].item())
        return PromptState(
            input_ids=input_ids,
            embeds=out.inputs_embeds,
            # One dtype for every prompt (text-only rows come back int64, image rows int32), so
            # image requests reuse the kernels the text warm-up compiled for each length bucket.
            position_ids=None if out.position_ids is None else out.position_ids.astype(mx.int32),
            rope_delta=rope_delta,
            cache=vlm_cache.make_prompt_cache(self.language_model),
        )

    def prefill(self, state: PromptState, start: int, end: int) -> mx.array:
        """Run prompt positions [start, end) into the request's cache; return last-position logits (1, V)."""
        kwargs = {}
        if state.position_ids is not None:
            kwargs["position_ids"] = state.position_ids[..., start:end]
        out = self.language_model(
            state.input_ids[:, start:end],
            inputs_embeds=state.embeds[:, start:end],
            cache=state.cache,
            **kwargs,
        )
        return out.logits[:, -1, :]

    def prefill_batch(self, states: list[PromptState], lengths: list[int], bucket: int = 1) -> list[Any]:
        """Prefill prompt[:n] of several requests in one left-padded forward; returns their batch cache.

        The padded length is rounded up to a multiple of `bucket`, so prompts of many lengths
        share a few kernel shapes (a shape seen for the first time costs a compile on CUDA)."""
        longest = -(-max(lengths) // bucket) * bucket
        pads = [longest - n for n in lengths]

        def stack(arrays, axis):
            # Always a fresh row-contiguous array: kernels are compiled per memory layout too, and a
            # lone broadcast or sliced view would miss the ones warm-up compiled.
            return mx.contiguous(mx.concatenate(arrays, axis=axis))

        def left_pad(x, n, pad, axis):
            x = x[..., :n] if axis == x.ndim - 1 else x[:, :n]
            widths = [(0, 0)] * x.ndim
            widths[axis] = (pad, 0)
            return mx.pad(x, widths) if pad else x

        ids = stack([left_pad(st.input_ids, n, p, 1) for st, n, p in zip(states, lengths, pads)], 0)
        embeds = stack([left_pad(st.embeds, n, p, 1) for st, n, p in zip(states, lengths, pads)], 0)
        kwargs = {}
        if states[0].position_ids is not None:
            # Text-only rows carry (1, L) positions, image rows (3, 1, L) M-RoPE ones.
            pos = [
                st.position_ids
                if st.position_ids.ndim == 3
                else mx.broadcast_to(st.position_ids[None], (3, *st.position_ids.shape))
                for st in states
            ]
            kwargs["position_ids"] = stack([left_pad(p_, n, p, 2) for p_, n, p in zip(pos, lengths, pads)], 1)
        cache = [vlm_cache.BatchKVCache(pads) for _ in states[0].cache]
        self.language_model(ids, inputs_embeds=embeds, cache=cache, **kwargs)
        return cache

    # ---- batched decode ------------------------------------------------------
    def kv_layout(self) -> tuple[int, tuple[int, int, int], Any]:
        """(layers, (kv_heads, key_dim, value_dim), dtype) of the KV cache, read off a one-token forward."""
        if self._kv_layout is None:
            cache = vlm_cache.make_prompt_cache(self.language_model)
            kwargs = {"position_ids": mx.zeros((3, 1, 1), dtype=mx.int32)} if self.uses_mrope else {}
            self.language_model(mx.zeros((1, 1), dtype=mx.int32), cache=cache, **kwargs)
            k, v = cache[0].state
            self._kv_layout = (len(cache), (k.shape[1], k.shape[3], v.shape[3]), k.dtype)
        return self._kv_layout

    def merge_caches(self, caches: list[list[Any]]) -> list[Any]:
        """Per-request caches -> one batch cache per layer (left-padded)."""
        return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]

    def decode(self, tokens: mx.array, batch_cache: list[Any], positions: mx.array | None) -> mx.array:
        """One step for every running row: tokens (B,), positions (B,) for M-RoPE; returns logits (B, V)."""
        kwargs = {}
        if positions is not None:
            pos = positions.reshape(1, -1, 1)
            kwargs["position_ids"] = mx.broadcast_to(pos, (3, pos.shape[1], 1))
            if self.fast_decode and qwen_decode.applies(batch_cache):
                return qwen_decode.forward(self.language_model, tokens, batch_cache, kwargs["position_ids"])
        out = self.language_model(tokens[:, None], cache=batch_cache, **kwargs)
        return out.logits[:, -1, :]
