"""Qwen2-VL / Qwen2.5-VL fast paths over the generic adapter.

- Pixels arrive packed (processing.py): uint8 frames plus a table, expanded into patches here.
- All images of several prompts share one vision-tower call (the tower takes many images'
  patches with their grids), and image prompts are embedded from host-side indices
  (embedding.py), so the worker never waits on a device read while embedding.
- On CUDA the tower's attention runs all of a call's images in one launch of a plan-free
  kernel, or, for a call with a lot of attention, one cuDNN call per run of equal segments
  (vision_attention.py); warm-up builds the cuDNN plans of its image sizes, and the engine
  builds others while idle.
- On CUDA a decode step over the slot cache takes the fused layer path (decode.py), and a
  prompt forward its own layer path in fewer primitives (prefill.py).
Each is tested equal to `GenericModel`'s path.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.models import cache as vlm_cache

from vlmserve.engine.ops import cuda_kernels, few_row_matmul, few_row_quantized, prefill_attention
from vlmserve.engine.ops.attention_plans import AttentionPlans
from vlmserve.models.generic import GenericModel, PromptState, device_inputs, mrope_decode_positions, rows_at
from vlmserve.models.qwen2_vl import decode as qwen_decode
from vlmserve.models.qwen2_vl import embedding, packed_pixels, vision_attention
from vlmserve.models.qwen2_vl import prefill as qwen_prefill
from vlmserve.protocol import PreparedRequest

# Patches one vision-tower call takes (a larger image alone). The tower's activations grow with
# its input: MLX's peak above the weights for a 2B model's tower was 5.5 GB at 8 images of 448x448
# (8,192 patches), 12.3 GB at 16 and 14.6 GB at 33 (H200, benchmarks/vision_memory.py), for
# 4.4 against 3.6 ms per image.
TOWER_PATCHES = 8192
# On CUDA each of the tower's matmul shapes (and its patch convolution) is set up once per row
# count: 3-10 ms for each at a new count (cuBLASLt; H200, the 2B tower's widths), some 20 ms a
# call on the request path, and images of mixed sizes packed into one call make a new count
# almost every call. Calls that take the one attention launch run on their patches rounded up
# to a multiple of this (zeros past the images, in segments of their own), and idle time runs
# each such count up to TOWER_PATCHES once, so traffic meets none of them first.
TOWER_ROW_STEP = 512
# The towers whose call is built on the host (embedding.py): same features as mlx_vlm's call,
# without its device reads, and able to run on more rows than the images'.
_HOST_TOWERS = {"qwen2_vl": embedding.qwen2_vl_tower, "qwen2_5_vl": embedding.qwen2_5_vl_tower}


def _patches(grid: np.ndarray) -> int:
    """Patches the tower takes for images of these (t, h, w) grids, (N, 3)."""
    return int(np.prod(grid, axis=1).sum())


def _tower_calls(requests: list[PreparedRequest], grids: dict) -> list[list[PreparedRequest]]:
    """The requests in order, grouped into tower calls of at most TOWER_PATCHES patches."""
    calls: list[list[PreparedRequest]] = []
    patches = 0
    for p in requests:
        n = _patches(grids[id(p)])
        if not calls or patches + n > TOWER_PATCHES:
            calls.append([])
            patches = 0
        calls[-1].append(p)
        patches += n
    return calls


def _content_keyed(prepared: PreparedRequest, grid: np.ndarray) -> bool:
    """Whether each of its images (a row of `grid`) has a content hash, the feature cache's key
    (none has with --no-mm-cache)."""
    return len(prepared.image_hashes) == len(grid)


def image_grids(prepared: PreparedRequest) -> np.ndarray:
    """The (t, h, w) patch grid of each of a request's images, (N, 3)."""
    grids = prepared.model_inputs.get("image_grid_thw")
    return np.zeros((0, 3), dtype=np.int64) if grids is None else np.asarray(grids).reshape(-1, 3)


class QwenVLModel(GenericModel):
    def install_fast_paths(self) -> None:
        if cuda_kernels.cudnn_enabled():  # image sizes warm-up did not meet skip cuDNN until idle time
            self.attention_plans = AttentionPlans()
        vision_attention.install(self.model.vision_tower, self.attention_plans)
        if cuda_kernels.enabled():
            tower = self.model.vision_tower
            vision_attention.note_builds(tower, tower.patch_embed.proj.weight.dtype)
        super().install_fast_paths()
        self.pads_tower_rows = self._pads_tower_rows()
        if self.pads_tower_rows:
            buckets = range(TOWER_ROW_STEP, TOWER_PATCHES + 1, TOWER_ROW_STEP)
            self.idle_warmups += [partial(self._warm_tower_rows, rows) for rows in buckets]
        self.fast_decode = qwen_decode.supports(self.language_model)
        self.fast_prefill = qwen_decode.same_layers(self.language_model)
        if self.fast_prefill and cuda_kernels.enabled():
            self._note_prompt_attention_build()
        # On CUDA, where its prompt forward is its own (prefill.py), a prompt's last position runs
        # in that forward and its first token comes from there: a decode step less before it
        # (~6 ms of a follow-up turn's TTFT on an H100). Those logits come from a forward over many
        # positions instead of a one-token step: equal to bf16 rounding, as the decode step's
        # kernels are. Elsewhere mlx_vlm.generate's split stays, bit for bit.
        self.samples_in_prefill = self.fast_prefill and cuda_kernels.enabled()
        if self.fast_decode:  # its decode sends its linear layers to the few-row kernels
            lm = self.language_model
            quantized, dense = few_row_quantized.pending(lm), few_row_matmul.pending(lm)
            self.kernel_checks = [partial(few_row_quantized.check, *item) for item in quantized]
            self.kernel_checks += [partial(few_row_matmul.check, *item) for item in dense]
            # Their builds compile in side processes meanwhile; each check then reads its build from disk.
            few_row_quantized.prefetch(quantized)
            few_row_matmul.prefetch(dense)
            few_row_matmul.prefetch_served(lm)

    def pixel_dtype(self) -> str | None:
        # get_input_embeddings casts pixels to the tower's dtype first: preprocessing ships them cast
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        return {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype)

    # ---- prompt ---------------------------------------------------------------
    def stage_inputs(self, prepared: PreparedRequest) -> dict[str, mx.array]:
        host = prepared.model_inputs
        inputs = device_inputs({k: v for k, v in host.items() if k != "pixel_layout"}, prepared.bfloat16_inputs)
        if "pixel_bytes" in inputs:  # packed frames: the patches are made here, on the device
            inputs["pixel_values"] = packed_pixels.expand(
                inputs.pop("pixel_bytes"), inputs.pop("pixel_table"), image_grids(prepared), host["pixel_layout"]
            )
        return inputs

    def embed_prompts(
        self, prepared: list[PreparedRequest], staged: list[dict[str, mx.array] | None] | None = None
    ) -> list[PromptState]:
        """The images of these prompts go through the vision tower together, as few calls as
        TOWER_PATCHES allows (one launch sequence instead of one per image); image prompts are
        embedded from host-side indices."""
        staged = staged or [None] * len(prepared)
        inputs = {id(p): s for p, s in zip(prepared, staged) if s is not None}
        with_images = [p for p in prepared if p.has_pixels]
        if not with_images:
            return [self.embed_prompt(p, inputs=inputs.get(id(p))) for p in prepared]
        grids = {id(p): image_grids(p) for p in with_images}
        merge = self.model.config.vision_config.spatial_merge_size**2
        per_request = self._cached_features(with_images, grids)
        # Requests with the same images (several questions about one picture) share one tower run.
        same: dict = {}
        for p in with_images:
            if id(p) not in per_request:
                same.setdefault(p.image_hashes or id(p), []).append(p)
        todo = [group[0] for group in same.values()]
        if todo:
            dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
            for p in todo:  # one host->device copy per request not staged already
                if id(p) not in inputs:
                    inputs[id(p)] = self.stage_inputs(p)
            computed = {}
            calls = _tower_calls(todo, grids)
            for i, call in enumerate(calls):
                pixels = mx.concatenate([inputs[id(p)]["pixel_values"] for p in call]).astype(dtype)
                features = self._tower(pixels, np.concatenate([grids[id(p)] for p in call]))
                if i < len(calls) - 1:
                    # Done before the next call is queued: queued calls hold their activations at once.
                    mx.eval(features)
                else:
                    # Started now: the per-request embedding below is host work (M-RoPE positions),
                    # done while the device runs the tower's last command buffers.
                    mx.async_eval(features)
                rows = np.cumsum([_patches(grids[id(p)]) // merge for p in call])[:-1]
                computed.update(zip((id(p) for p in call), mx.split(features, rows.tolist())))
            self._store_features(todo, grids, computed, merge)
            for group in same.values():
                for p in group:
                    per_request[id(p)] = computed[id(group[0])]
                    looked_up = _content_keyed(p, grids[id(p)])  # as in _cached_features
                    if p is not group[0] and self.feature_cache is not None and looked_up:
                        self.feature_cache.shared()  # its lookup missed; it skipped the tower all the same
        return [
            self._embed_image_prompt(p, per_request[id(p)], grids[id(p)], inputs.get(id(p)))
            if id(p) in per_request
            else self.embed_prompt(p, inputs=inputs.get(id(p)))
            for p in prepared
        ]

    def _cached_features(self, prepared: list[PreparedRequest], grids: dict) -> dict[int, mx.array]:
        """The requests whose every image's features are cached (FeatureCache), by id."""
        found = {}
        if self.feature_cache is None:
            return found
        for p in prepared:
            if _content_keyed(p, grids[id(p)]):
                hit = self.feature_cache.lookup(p.image_hashes)
                if hit is not None:
                    found[id(p)] = hit[0] if len(hit) == 1 else mx.concatenate(hit)
        return found

    def _store_features(self, prepared: list[PreparedRequest], grids: dict, features: dict, merge: int) -> None:
        if self.feature_cache is None:
            return
        for p in prepared:
            grid = grids[id(p)]
            if not _content_keyed(p, grid):
                continue
            rows = np.cumsum([int(np.prod(g)) // merge for g in grid])[:-1]
            for key, part in zip(p.image_hashes, mx.split(features[id(p)], rows.tolist())):
                self.feature_cache.store(key, part)

    def _tower(self, pixels: mx.array, grid: np.ndarray) -> mx.array:
        """All images' features from one vision-tower call."""
        tower = _HOST_TOWERS.get(self.info.model_type)
        if tower is not None:
            return tower(self.model.vision_tower, pixels, grid, self._tower_rows(grid))
        return self.model.vision_tower(pixels, mx.array(grid), output_hidden_states=False)

    def _pads_tower_rows(self) -> bool:
        """Whether tower calls run on TOWER_ROW_STEP multiples of rows: the towers whose call is
        built on the host here (Qwen2-VL, Qwen2.5-VL: _HOST_TOWERS), on CUDA, where the one
        attention launch serves their heads."""
        tower = self.model.vision_tower
        return (
            self.model.config.model_type in _HOST_TOWERS  # `info` is made after the fast paths
            and cuda_kernels.enabled()
            and vision_attention.one_launch_serves(tower, tower.patch_embed.proj.weight.dtype)
        )

    def _tower_rows(self, grid: np.ndarray) -> int | None:
        """The rows a tower call of these images runs on (None: its own), see TOWER_ROW_STEP. A
        call with attention enough for cuDNN's route keeps its shape (its segments are cuDNN's)."""
        if not self.pads_tower_rows:
            return None
        seqlens = embedding.frame_lengths(grid).tolist()
        rows = -(-sum(seqlens) // TOWER_ROW_STEP) * TOWER_ROW_STEP
        padded = seqlens + embedding.pad_segments(rows - sum(seqlens), max(seqlens))
        if vision_attention.may_take_cudnn(seqlens) or vision_attention.may_take_cudnn(padded):
            return None
        return rows

    def _warm_tower_rows(self, rows: int) -> None:
        """One tower call on `rows` patches (TOWER_ROW_STEP-patch images of zeros): its row count's
        matmuls and convolution set up before traffic brings it."""
        vc = self.model.config.vision_config
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        side = int(np.sqrt(TOWER_ROW_STEP // 2))  # a (side, 2 * side) image: TOWER_ROW_STEP patches
        grid = np.array([[1, side, 2 * side]] * (rows // TOWER_ROW_STEP), dtype=np.int64)
        mx.eval(self._tower(mx.zeros((rows, width), dtype=dtype), grid))

    def _note_prompt_attention_build(self) -> None:
        """Queue the prompt forward's attention kernel build (prefill.py) ahead of the first prompt."""
        attn = self.language_model.model.layers[0].self_attn
        embed = self.language_model.model.embed_tokens
        dtype = getattr(embed, "scales", embed.weight).dtype  # what a prompt's embeddings come out as
        if prefill_attention.serves(dtype, attn.n_heads, attn.n_kv_heads, attn.head_dim):
            prefill_attention.note_build(dtype, attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale)

    def warm_vision(self, prepared: PreparedRequest, max_images: int) -> int:
        return sum(len(self.warm_vision_plans(tuple(grid), max_images)) for grid in image_grids(prepared).tolist())

    def warm_vision_plans(self, grid_thw: tuple[int, int, int], max_images: int) -> list[int]:
        """Run the tower on one image of this size and build cuDNN's attention plans for it at
        every power-of-two image count up to `max_images`, so calls large enough for cuDNN's
        route (vision_attention) find them; returns the counts planned (none where the tower's
        attention does not go to cuDNN)."""
        if not cuda_kernels.cudnn_enabled() or self.attention_plans is None:
            return []
        vc = self.model.config.vision_config
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        t, h, w = grid_thw
        per_image = t * h * w
        max_images = min(max_images, max(1, TOWER_PATCHES // per_image))  # what one call takes
        counts = [t << i for i in range(max(1, max_images).bit_length())]  # frames of h x w patches
        mx.eval(self._tower(mx.zeros((per_image, width), dtype=dtype), np.array([grid_thw], dtype=np.int64)))
        return vision_attention.build_plans(self.model.vision_tower, dtype, h * w, counts, self.attention_plans)

    def _embed_image_prompt(
        self, prepared: PreparedRequest, features: mx.array, grid: np.ndarray, inputs: dict[str, mx.array] | None
    ) -> PromptState:
        ids = prepared.prompt_ids.astype(np.int32)
        cfg = self.language_model.config  # what mlx_vlm's get_rope_index reads
        found = embedding.mrope_positions(
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
            embeds=embedding.merge_image_features(embeds, features, ids, self.model.config.image_token_id),
            position_ids=mx.array(positions)[:, None, :],
            position_offset=rope_delta,
            cache=vlm_cache.make_prompt_cache(self.language_model),
        )

    # ---- prefill and batched decode -------------------------------------------
    def _prompt_forward(
        self, ids: mx.array, embeds: mx.array, cache: list[Any], kwargs: dict, last: list[int] | None = None
    ) -> mx.array:
        if not (self.fast_prefill and qwen_prefill.applies(kwargs)):
            return super()._prompt_forward(ids, embeds, cache, kwargs, last)
        h = qwen_prefill.forward(self.language_model, embeds, kwargs["position_ids"], cache)
        # Only the positions asked for go through the output layer (a 150k-wide matmul per position).
        return qwen_prefill.logits(self.language_model, h if last is None else rows_at(h, last))

    def decode(self, tokens: mx.array, batch_cache: list[Any], positions: mx.array | None) -> mx.array:
        if positions is not None and self.fast_decode and qwen_decode.applies(batch_cache):
            return qwen_decode.forward(self.language_model, tokens, batch_cache, mrope_decode_positions(positions))
        return super().decode(tokens, batch_cache, positions)
