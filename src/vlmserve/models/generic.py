"""The generic ModelAdapter: any mlx-vlm model through mlx-vlm's own classes.

Runs only on the MLX worker thread. It keeps what mlx_vlm keeps on the shared model object
between calls (M-RoPE `_rope_deltas` / `_position_ids`) with each request instead, by always
passing explicit position ids to the language model. A family's fast path subclasses
`GenericModel` and is checked against it (models/registry.py picks the class).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.utils import load_model

from vlmserve.engine.ops import (
    cuda_kernels,
    decode_attention,
    depthwise_conv,
    fused_projections,
    gated_delta_scan,
    many_row_dequantized,
    rope_rotation,
    tower_attention,
)
from vlmserve.engine.ops.attention_plans import AttentionPlans
from vlmserve.models import kv_caches, output_rows
from vlmserve.models.image_rows import ImageRows
from vlmserve.models.output_rows import rows_at
from vlmserve.models.ragged_cache import RaggedLayerCache, RaggedStateCache
from vlmserve.protocol import ModelInfo, PreparedRequest

log = logging.getLogger(__name__)

# Embedding outputs that only make sense for a single, unpadded row.
_PER_ROW_ONLY = {"attention_mask_4d", "labels", "attention_mask"}
# Extra embedding outputs the language model takes with every prompt forward, and how a chunk
# or a left-padded batch takes them: `visual_pos_masks` (1, L) follows the prompt's tokens;
# `deepstack_visual_embeds` (layers, n_visual, D) has one row per True position of that mask
# (Qwen3-VL's deepstack: added to the first layers' hidden states at the image tokens). A
# one-token decode step never holds an image token, so decode passes neither.
_TOKEN_MASK = "visual_pos_masks"
_MASK_ROWS = "deepstack_visual_embeds"
# Extra embedding outputs with one entry per prompt position on axis 1 (Gemma-3n's
# per_layer_inputs (1, L, layers, D)): a chunk takes its slice, a left-padded batch pads them.
# A decode step passes none: the language model derives them from the token id.
_PER_POSITION = {"per_layer_inputs"}


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


def device_inputs(host: dict[str, np.ndarray], bfloat16: frozenset[str] = frozenset()) -> dict[str, mx.array]:
    """NumPy inputs as MLX arrays; those named in `bfloat16` hold bfloat16 bit patterns (uint16)."""
    return {k: host_to_mx(v).view(mx.bfloat16) if k in bfloat16 else host_to_mx(v) for k, v in host.items()}


def _call_signature(prepared: PreparedRequest) -> tuple:
    """What lays out a tower call's attention: its inputs' shapes and dtypes, and the values of its
    image grids (a tower that slices each image out of the call lays it out by the others).
    Inputs as long as the prompt (token types, labels) say nothing about the tower: left out."""
    length = prepared.num_prompt_tokens
    out = []
    for name in sorted(prepared.model_inputs):
        v = np.asarray(prepared.model_inputs[name])
        if v.ndim <= 2 and v.ndim and v.shape[-1] == length:
            continue
        grid = "grid" in name and v.dtype.kind in "iu"
        out.append((name, v.shape, v.dtype.str, tuple(v.reshape(-1).tolist()) if grid else None))
    return tuple(out)


def _stand_in_pixels(pixels: np.ndarray) -> Callable[[], np.ndarray]:
    """Pixels of `pixels`' shape for a rebuild, holding none of its memory: ones, but zeros for
    each image (the last three axes) that was all zeros (a tower may drop those as padding)."""
    shape, dtype = pixels.shape, pixels.dtype
    blank = ~pixels.reshape(*shape[:-3], -1).any(axis=-1) if pixels.ndim >= 4 else None

    def make() -> np.ndarray:
        out = np.ones(shape, dtype)
        if blank is not None:
            out[blank] = 0
        return out

    return make


def _context_length(config: dict) -> int:
    text = config.get("text_config") or {}
    for source in (text, config):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
            if isinstance(source.get(key), int):
                return int(source[key])
    return 4096


def _embed_tokens(language_model):
    """The token embedding: on the inner model (mlx-lm's layout) or on the language model itself."""
    inner = getattr(language_model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    return embed if embed is not None else language_model.embed_tokens


def _extra_inputs(out) -> dict[str, Any]:
    """What an embedding output hands the language model besides the embeddings and positions
    (per_layer_inputs, deepstack rows, ...), without those that fit a lone unpadded row only."""
    return {
        k: v
        for k, v in out.to_dict().items()
        if v is not None and k not in _PER_ROW_ONLY | {"inputs_embeds", "position_ids", "rope_deltas"}
    }


def _comparable(state: PromptState | None) -> dict | None:
    """What of a prompt state the language model reads (its fresh cache aside)."""
    if state is None:
        return None
    return {k: v for k, v in vars(state).items() if k != "cache"}


def _mergeable(cache) -> bool:
    """Whether a cache merges into a batch cache: its own class defines `merge` (a subclass that
    only inherits one, e.g. a ring or quantized variant of KVCache, would lose its own state),
    and so does every cache it holds (CacheList)."""
    if "merge" not in vars(type(cache)):
        return False
    return all(_mergeable(c) for c in getattr(cache, "caches", ()))


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
    position_offset: int  # a row's next position is its cache length plus this (M-RoPE's rope delta)
    cache: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)
    # The prompt's embeddings are wider than a token's (float32 image embeddings in a bfloat16
    # model), or the model reads a prompt embedding differently from a token id: its last
    # position runs in prefill from them, as mlx_vlm.generate runs it, not in the first decode
    # step from the token's own embedding.
    last_from_prompt: bool = False


class GenericModel:
    """The loaded model plus the calls the scheduler needs, all on the worker thread."""

    # The language model masks its sliding-window layers' window itself (make_mask with a
    # window_size, handed to exactly those layers), so plain caches may stand in for its rotating
    # ones (kv_caches.plain_for_windows): a family sets it once its forward is known to.
    windows_in_masks = False
    # Whether this model's vision tower attention takes tower_attention's route (set at load).
    routes_tower_attention = False

    def __init__(
        self,
        model_path: Path,
        fallback_eos: tuple[int, ...] = (),
        before_first_forward: Callable[[], object] | None = None,
    ):
        self.path = model_path
        started = time.perf_counter()
        self.model = load_model(model_path, lazy=False)
        # load_model(lazy=False) evaluates parameters; evaluate again to be sure any buffer too.
        mx.eval(self.model.parameters())
        read = time.perf_counter()
        newline = getattr(self.model, "image_newline", None)
        if isinstance(newline, mx.array) and newline.dtype == mx.bfloat16:
            # mlx-vlm's LLaVA-NeXT merge reads it through NumPy, which has no bfloat16; float32
            # holds the same values and the merge casts the result back to the embeddings' dtype.
            self.model.image_newline = newline.astype(mx.float32)
        self.config = json.loads((model_path / "config.json").read_text())
        self.language_model = self.model.language_model
        # M-RoPE families take explicit (3, B, L) positions; decode passes them per row.
        self.uses_mrope = hasattr(self.language_model, "get_rope_index")
        # Prefix-LM families (PaliGemma): the whole prompt attends bidirectionally, and the language
        # model then builds no mask of its own, not even for decode.
        text_config = getattr(self.model.config, "text_config", None)
        self.prefix_lm = bool(getattr(text_config, "use_bidirectional_attention", False))
        if self.windows_in_masks and not self.prefix_lm:  # a mask handed in would replace the windows
            kv_caches.plain_for_windows(self.language_model)
        # Caches mlx-lm cannot merge (ChunkedKVCache, QuantizedKVCache, ...) decode one row at a time.
        caches = vlm_cache.make_prompt_cache(self.language_model)
        self.can_batch = all(_mergeable(c) for c in caches)
        # Pieces of several prompts share a forward over plain KV caches (ragged_cache.py); turned
        # off if this model's forward turns out not to take that.
        self._pieces_work = kv_caches.pageable(caches)
        self.has_state_layers = any(kv_caches.is_state(c) for c in caches)  # convolution or recurrent state
        # Kernels the decode step would use, each built and checked before it is served; left
        # for the engine's warm-up (their builds are queued for side processes at load).
        self.kernel_checks: list[Callable[[], bool]] = []
        self.idle_warmups: list[Callable[[], None]] = []  # run once each while the engine is idle
        self.attention_plans: AttentionPlans | None = None  # set where a fast path plans attention shapes
        self.install_fast_paths()
        if before_first_forward is not None:  # the engine's kernel builds under way (side_builds)
            before_first_forward()
        swapped = time.perf_counter()
        self.token_dtype = _embed_tokens(self.language_model)(mx.zeros((1, 1), dtype=mx.int32)).dtype
        self.prompt_path_differs = self._prompt_path_differs()
        log.info(
            "model built: weights read in %.1f s, kernel swaps %.1f s, probes %.1f s",
            read - started,
            swapped - read,
            time.perf_counter() - swapped,
        )
        self.feature_cache = None  # a FeatureCache where the engine reuses vision features
        self._kv_layout = None
        self._state_layout: list | None = None
        eos = _eos_ids(model_path, self.config) or fallback_eos
        self.info = ModelInfo(
            path=str(model_path),
            model_type=self.config.get("model_type", "unknown"),
            context_length=_context_length(self.config),
            vocab_size=int(_embed_tokens(self.language_model).weight.shape[0]),
            eos_token_ids=tuple(eos),
            image_token_id=getattr(self.model.config, "image_token_id", None)
            or getattr(self.model.config, "image_token_index", None),
            pixel_dtype=self.pixel_dtype(),
        )
        self.image_rows = ImageRows(self.info.image_token_id)

    def install_fast_paths(self) -> None:
        """Kernel swaps that keep every output (engine/ops; each tested against mlx_vlm's path)."""
        fused_projections.install(self.language_model)
        rope_rotation.install()
        decode_attention.install()
        depthwise_conv.install(self.language_model)
        gated_delta_scan.install(self.language_model)
        if cuda_kernels.enabled():  # elsewhere MLX's quantized matmul stays (and mlx_vlm's outputs, bit for bit)
            many_row_dequantized.install(self.model)
            many_row_dequantized.prefetch(self.model)  # builds a first prompt takes, compiled meanwhile
        # The tower's own attention calls skip cuDNN for shapes without a plan (tower_attention),
        # unless a family routes them itself (and set attention_plans before this).
        self.routes_tower_attention = self.attention_plans is None and tower_attention.available()
        if self.routes_tower_attention:
            self.attention_plans = AttentionPlans()
        output_rows.install(self.language_model)  # prompt forwards' logits at the rows read only

    def row_memory(self) -> tuple[int, int] | None:
        """What one request's caches hold on the device: bytes per position (the keys and values of
        every layer that keeps all positions) and fixed bytes (recurrent or convolution state, and
        a rotating cache's window, counted full), from caches filled by a two-token forward; None
        where a cache is of a kind not counted here, or the forward fails."""
        counted = (vlm_cache.KVCache, vlm_cache.RotatingKVCache, vlm_cache.ArraysCache)
        caches = vlm_cache.make_prompt_cache(self.language_model)
        if any(type(c) not in counted for c in caches):
            return None
        try:
            self.language_model(mx.zeros((1, 2), dtype=mx.int32), cache=caches)
            layers = [[a for a in cache.state if a is not None] for cache in caches]
            mx.eval(layers)
        except Exception:  # noqa: BLE001 - an unusual forward: the model runs without a KV budget
            log.warning("%s: could not measure a request's caches", self.info.model_type, exc_info=True)
            return None
        finally:
            self._forget_positions()
        per_position = fixed = 0
        for cache, arrays in zip(caches, layers):
            nbytes = sum(a.nbytes for a in arrays)
            if type(cache) is vlm_cache.ArraysCache:
                fixed += nbytes
            elif type(cache) is vlm_cache.RotatingKVCache:  # at most its window, whatever the context
                fixed += nbytes // 2 * cache.max_size
            else:  # the state holds the two positions
                per_position += nbytes // 2
        return per_position, fixed

    def kernels_pending(self) -> int:
        """Kernel builds and checks left for the engine (`build_next_kernel`): warm-up runs them."""
        return len(self.kernel_checks)

    def build_next_kernel(self) -> None:
        """Build and check one kernel the decode step may use; until it passes, MLX's op serves."""
        self.kernel_checks.pop(0)()

    def idle_warmups_pending(self) -> int:
        return len(self.idle_warmups)

    def warm_next_idle(self) -> None:
        try:
            self.idle_warmups[0]()
        finally:  # counted as pending until it has run; one that fails is not tried again
            self.idle_warmups.pop(0)

    def attention_plans_pending(self) -> int:
        """Attention shapes met without a cuDNN plan, whose plans are built while idle."""
        return 0 if self.attention_plans is None else self.attention_plans.pending()

    def attention_plan_due(self) -> bool:
        """Whether one of them has lost enough to the plan-free kernel to be built between two steps
        (attention_plans.PLAN_BUILD_S)."""
        return self.attention_plans is not None and self.attention_plans.hot()

    def build_next_attention_plan(self, hot: bool = False) -> None:
        """Build one of them (`hot`: the one due); until then a plan-free kernel serves that shape."""
        self.attention_plans.build_next(hot)

    def _prompt_path_differs(self) -> bool:
        """Whether the language model reads a text token differently from its id than from the
        prompt embedding (Gemma-3n scales only the id's embedding). mlx_vlm.generate runs a
        prompt's last position from the prompt embedding; where the two differ, so must we.

        Probed once on a few text tokens: the id path against the embedding path, bit for bit.
        A probe that fails assumes they differ, which costs speed (no batched prefill), never output."""
        # Ordinary text tokens: special ones sit at either end of a vocabulary, and a fixture's
        # may embed as zeros, which every path reads alike.
        start = int(_embed_tokens(self.language_model).weight.shape[0]) // 3
        ids = mx.arange(start, start + 4, dtype=mx.int32)[None]
        try:
            by_id = self.language_model(ids, cache=vlm_cache.make_prompt_cache(self.language_model)).logits
            out = self.model.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, dtype=mx.int32))
            extra = _extra_inputs(out)
            cache = vlm_cache.make_prompt_cache(self.language_model)
            by_embedding = self.language_model(ids, inputs_embeds=out.inputs_embeds, cache=cache, **extra).logits
            return not bool(mx.array_equal(by_id, by_embedding).item())
        except Exception:  # noqa: BLE001 - an unusual family: take the path that keeps output
            log.warning(
                "%s: could not compare how the model reads ids and embeddings; prompts run their last "
                "position in prefill (no batched prefill)",
                self.config.get("model_type", "model"),
                exc_info=True,
            )
            return True
        finally:
            self._forget_positions()

    def _forget_positions(self) -> None:
        """Drop the M-RoPE state mlx-vlm leaves on the shared language model (GLM-4V): another
        request must never read it."""
        for name in ("_position_ids", "_rope_deltas"):
            if getattr(self.language_model, name, None) is not None:
                setattr(self.language_model, name, None)

    def pixel_dtype(self) -> str | None:
        """The dtype the model casts pixel_values to before any arithmetic, where preprocessing may
        ship them already cast (ModelInfo.pixel_dtype); None: as the processor makes them."""
        return None

    # ---- prompt ---------------------------------------------------------------
    def stage_inputs(self, prepared: PreparedRequest) -> dict[str, mx.array]:
        """A request's arrays copied into MLX now, ahead of its embedding (`embed_prompts(staged=)`)."""
        return device_inputs(prepared.model_inputs, prepared.bfloat16_inputs)

    def embed_prompts(
        self, prepared: list[PreparedRequest], staged: list[dict[str, mx.array] | None] | None = None
    ) -> list[PromptState]:
        """Embed several prompts; `staged` holds `stage_inputs` results (or None) per request."""
        staged = staged or [None] * len(prepared)
        return [self.embed_prompt(p, inputs=s) for p, s in zip(prepared, staged)]

    def warm_vision(self, prepared: PreparedRequest, max_images: int) -> int:
        """Build the vision tower's shapes for this request's image sizes at up to `max_images`
        images per call; returns the tower runs made: on CUDA, one of the request's own, whose
        attention shapes get their cuDNN plans (tower_attention)."""
        if not (self.routes_tower_attention and prepared.has_pixels):
            return 0
        with self.attention_plans.building():
            mx.eval(self._tower_call(prepared).inputs_embeds)
        return 1

    def _device_prompt(self, prepared: PreparedRequest, staged: dict[str, mx.array] | None = None):
        """A request's ids, pixels, mask and other inputs on the device (`staged`: its
        `stage_inputs`, if copied already): what `get_input_embeddings` takes."""
        input_ids = mx.array(prepared.prompt_ids.astype(np.int32))[None]
        inputs = dict(staged if staged is not None else self.stage_inputs(prepared))
        pixel_values = inputs.pop("pixel_values", None)
        return input_ids, pixel_values, mx.ones(input_ids.shape, dtype=mx.int32), inputs

    def tower_call_key(self, prepared: PreparedRequest) -> Hashable:
        """The part of a tower attention shape's key that the rest of its call decides: the
        call's signature, as a tower that slices each image out of the call lays it out by the
        others (tower_attention)."""
        return _call_signature(prepared)

    def _embed_pixels(self, prepared: PreparedRequest, input_ids: mx.array, pixel_values, mask: mx.array, inputs: dict):
        """The model's embedding of a prompt with its images (the vision tower's call), its
        attention routed off new cuDNN plans where this model's is (tower_attention)."""
        if not self.routes_tower_attention or pixel_values is None:
            return self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs)
        with tower_attention.routed(
            self.attention_plans, self.tower_call_key(prepared), lambda: self._tower_rebuild(prepared)
        ):
            return self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs)

    def _tower_call(self, prepared: PreparedRequest):
        """The request's tower call alone (its embedding, unevaluated), leaving no position state
        on the model."""
        try:
            return self._embed_pixels(prepared, *self._device_prompt(prepared))
        finally:
            self._forget_positions()

    def _tower_rebuild(self, prepared: PreparedRequest) -> Callable[[], None]:
        """The same tower call again, for the cuDNN plans of its shapes: on stand-in pixels of
        its pixels' shape (values do not shape a plan), its other inputs as they were, kept on
        the host, so a queued rebuild holds no device memory. Run under `building()`, the call
        marks each shape it meets as planned (the same signature: the same shapes)."""
        host = dict(prepared.model_inputs)
        pixels = host.pop("pixel_values", None)
        stand_in = None if pixels is None else _stand_in_pixels(pixels)
        del pixels
        ids, bfloat16 = prepared.prompt_ids, prepared.bfloat16_inputs

        def rebuild() -> None:
            arrays = host if stand_in is None else {**host, "pixel_values": stand_in()}
            again = PreparedRequest(prompt_ids=ids, model_inputs=arrays, bfloat16_inputs=bfloat16)
            mx.async_eval(self._tower_call(again).inputs_embeds)  # cuDNN builds each plan as its call is queued

        return rebuild

    def embed_prompt(
        self,
        prepared: PreparedRequest,
        image_features: mx.array | None = None,
        inputs: dict[str, mx.array] | None = None,
    ) -> PromptState:
        """NumPy -> mx on this thread (unless `inputs` already holds it), then vision encoder + token
        embeddings; or, for images embedded before, the text embeddings with their rows (image_rows.py)."""
        input_ids, pixel_values, mask, inputs = self._device_prompt(prepared, inputs)
        if image_features is not None:
            inputs["cached_image_features"] = image_features
        reuse = None
        if image_features is None and pixel_values is not None and self.feature_cache is not None:
            reuse = self.image_rows.key(prepared.image_hashes, prepared.prompt_ids)
        if reuse is not None:
            key, positions = reuse
            hit = self.feature_cache.lookup((key,), fits=lambda found: found[0][0].shape[0] == len(positions))
            if hit is not None:
                return self._embed_around_rows(prepared, input_ids, mask, inputs, positions, hit[0])
        out = self._embed_pixels(prepared, input_ids, pixel_values, mask, inputs)
        state = self._prompt_state(prepared, input_ids, inputs, out, mask)
        if reuse is not None:
            # The image's rows, and its rows for the layers that take vision features again (deepstack).
            deepstack = getattr(out, _MASK_ROWS, None)
            remembered = (
                self.image_rows.take(out.inputs_embeds, positions),
                None if deepstack is None else list(deepstack),
            )
            if self.image_rows.works is None:
                try:
                    rebuilt = self._embed_around_rows(prepared, input_ids, mask, inputs, positions, remembered)
                except Exception:  # noqa: BLE001 - a text path this family does not take: no reuse
                    log.debug("%s: the text path failed on an image prompt", self.info.model_type, exc_info=True)
                    rebuilt = None
                self.image_rows.check(self.info.model_type, _comparable(state), _comparable(rebuilt))
            if self.image_rows.works:
                mx.async_eval(remembered[0])  # its own buffer, computed with the prompt's embedding
                self.feature_cache.store(key, remembered)
        return state

    def _embed_around_rows(
        self, prepared: PreparedRequest, input_ids: mx.array, mask: mx.array, inputs: dict, positions, remembered
    ) -> PromptState:
        """The prompt from the model's text path, with remembered image rows at the placeholders
        (and, for deepstack models, the image's rows for those layers, at the same positions)."""
        rows, deepstack = remembered
        out = self.model.get_input_embeddings(input_ids, None, mask=mask, **inputs)
        changes = {"inputs_embeds": self.image_rows.place(out.inputs_embeds, positions, rows)}
        if deepstack is not None:
            changes[_MASK_ROWS] = deepstack
            changes[_TOKEN_MASK] = input_ids == self.info.image_token_id
        if self.uses_mrope:  # a text path gives text positions (Qwen3-VL's): _prompt_state makes the images' ones
            changes["position_ids"] = changes["rope_deltas"] = None
        return self._prompt_state(prepared, input_ids, inputs, dataclasses.replace(out, **changes), mask)

    def _prompt_state(self, prepared: PreparedRequest, input_ids: mx.array, inputs: dict, out, mask) -> PromptState:
        """A PromptState from the model's embedding output."""
        position_ids, rope_deltas = out.position_ids, out.rope_deltas
        if self.uses_mrope and position_ids is None:
            # GLM-4V keeps an image prompt's M-RoPE positions on the shared language model
            # (`_position_ids`/`_rope_deltas`) instead of returning them, and none for text:
            # compute them for this request, and leave nothing on the model for another to read.
            position_ids, rope_deltas = self.language_model.get_rope_index(
                input_ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), mask
            )
        self._forget_positions()
        extra = _extra_inputs(out)
        unknown = set(extra) - {_TOKEN_MASK, _MASK_ROWS} - _PER_POSITION
        if unknown or (_MASK_ROWS in extra and _TOKEN_MASK not in extra):
            raise NotImplementedError(f"{self.info.model_type}: embedding outputs {sorted(extra)} are not supported")
        if _MASK_ROWS in extra:
            extra[_MASK_ROWS] = list(extra[_MASK_ROWS])
        elif _TOKEN_MASK in extra:
            del extra[_TOKEN_MASK]  # without rows to place, the mask does nothing
        if _TOKEN_MASK in extra:
            # Host copy: how many mask rows precede each position (chunk and batch slicing).
            extra["_mask_before"] = np.concatenate([[0], np.cumsum(np.array(extra[_TOKEN_MASK]).reshape(-1))])
        embeds = out.inputs_embeds
        if embeds.shape[1] != input_ids.shape[1]:
            # The merge changed the prompt's length (LLaVA-NeXT puts several feature chunks per
            # image token). The language model reads only the embeddings: ids of their length
            # stand in, ending in the prompt's true last token (the first decode step's input).
            input_ids = mx.full((1, embeds.shape[1]), int(prepared.prompt_ids[-1]), dtype=mx.int32)
        offset = 0
        if rope_deltas is not None:
            offset = int(mx.array(rope_deltas).reshape(-1)[0].item())
        return PromptState(
            input_ids=input_ids,
            embeds=embeds,
            # One dtype for every prompt (text-only rows come back int64, image rows int32), so
            # image requests reuse the kernels the text warm-up compiled for each length bucket.
            position_ids=None if position_ids is None else position_ids.astype(mx.int32),
            position_offset=offset,
            cache=vlm_cache.make_prompt_cache(self.language_model),
            extra=extra,
            last_from_prompt=(out.inputs_embeds.dtype != self.token_dtype or self.prompt_path_differs)
            and not self.prefix_lm,
        )

    @staticmethod
    def _mask_rows(state: PromptState, start: int, end: int) -> list[mx.array] | None:
        """The deepstack rows of prompt positions [start, end), or None if none is visual."""
        before = state.extra.get("_mask_before")
        if before is None or before[end] == before[start]:
            return None
        lo, hi = int(before[start]), int(before[end])
        return [layer[lo:hi] for layer in state.extra[_MASK_ROWS]]

    def prefill(self, state: PromptState, start: int, end: int) -> mx.array:
        """Run prompt positions [start, end) into the request's cache; return last-position logits (1, V)."""
        kwargs = {}
        if self.prefix_lm:
            # mlx_vlm runs the whole prompt in one bidirectional forward (its chunked_prefill_policy
            # says no chunks). Same here, then drop the last position: the last token rides the
            # first decode step, where it attends to every position, as its row of this pass does.
            if start != 0 or end != state.input_ids.shape[1] - 1:
                raise NotImplementedError(f"{self.info.model_type}: a prefix-LM prompt is prefilled in one piece")
            out = self.language_model(state.input_ids, inputs_embeds=state.embeds, cache=state.cache)
            for c in state.cache:
                c.trim(1)
            return out.logits[:, -2, :]
        if state.position_ids is not None:
            kwargs["position_ids"] = state.position_ids[..., start:end]
        for k in _PER_POSITION & state.extra.keys():
            kwargs[k] = state.extra[k][:, start:end]
        rows = self._mask_rows(state, start, end)
        if rows is not None:
            kwargs[_TOKEN_MASK] = state.extra[_TOKEN_MASK][:, start:end]
            kwargs[_MASK_ROWS] = rows
        ids, embeds = state.input_ids[:, start:end], state.embeds[:, start:end]
        return self._prompt_forward(ids, embeds, state.cache, kwargs, last=[end - start - 1])

    def prefill_batch(
        self, states: list[PromptState], lengths: list[int], bucket: int = 1
    ) -> tuple[list[Any], mx.array]:
        """Prefill prompt[:n] of several requests in one left-padded forward; returns their batch
        cache and each row's logits at its last position, (rows, V), lazily.

        The padded length is rounded up to a multiple of `bucket`, so prompts of many lengths
        share a few kernel shapes (a shape seen for the first time costs a compile on CUDA)."""
        if self.prefix_lm:
            lengths = [n + 1 for n in lengths]  # whole prompts (see prefill), trimmed below
        longest = -(-max(lengths) // bucket) * bucket
        pads = [longest - n for n in lengths]
        ids, embeds, kwargs = self._stacked_inputs(states, [(0, n) for n in lengths], longest, left=True)
        if self.prefix_lm:  # bidirectional, but never onto a row's left padding
            kwargs["mask"] = (mx.arange(longest)[None] >= mx.array(pads)[:, None])[:, None, None, :]
        cache = [
            vlm_cache.ArraysCache(len(c.cache), left_padding=pads)  # state layers mask the padding too
            if kv_caches.is_state(c)
            else vlm_cache.BatchKVCache(pads)
            for c in states[0].cache
        ]
        logits = self._prompt_forward(ids, embeds, cache, kwargs, last=[longest - 1] * len(states))
        if self.prefix_lm:
            for c in cache:
                c.trim(1)
        return cache, logits

    # Whether a prompt's first token may be sampled from the prefill forward that runs its last
    # position with the ones before it (else that position rides the first decode step, as in
    # mlx_vlm.generate, and prefill stops before it).
    samples_in_prefill = False

    def _prompt_forward(
        self, ids: mx.array, embeds: mx.array, cache: list[Any], kwargs: dict, last: list[int] | None = None
    ) -> mx.array:
        """The language model over prompt positions, into `cache`: its logits, (rows, L, V), or with
        `last` (a position per row) each row's there, (rows, V). Lazy: unread, never computed."""
        if last is None:
            return self.language_model(ids, inputs_embeds=embeds, cache=cache, **kwargs).logits
        with output_rows.at(last) as selection:  # the output layer over these positions only
            logits = self.language_model(ids, inputs_embeds=embeds, cache=cache, **kwargs).logits
        return logits[:, 0] if selection.taken and logits.shape[1] == 1 else rows_at(logits, last)

    @property
    def prefills_pieces(self) -> bool:
        """Whether `prefill_pieces` serves this model: rows with plain KV caches (and fixed-size
        state beside them), attended causally."""
        return self.can_batch and not self.prefix_lm and self._pieces_work

    def prefill_pieces(
        self, states: list[PromptState], spans: list[tuple[int, int]], bucket: int = 1, caches: list | None = None
    ) -> mx.array:
        """Prefill prompt positions [start, end) of several requests in one right-padded forward,
        each into its own cache, whatever each cache holds already (earlier pieces, a cached
        prefix), or with `caches` (a layer cache each, over these rows: their KV in the block
        pool, engine/ops/paged_prefill_cache) into those. The padded length is rounded up to a
        multiple of `bucket`. Returns each row's logits at the last position of its piece,
        (rows, V), lazily.

        A model whose forward cannot take it (a language model that needs its cache offset as a
        number) raises; its caches are left as they were and later steps prefill row by row."""
        longest = -(-max(e - s for s, e in spans) // bucket) * bucket
        ids, embeds, kwargs = self._stacked_inputs(states, spans, longest, left=False)
        lengths = [e - s for s, e in spans]
        cache = caches or self._pieces_caches(states, lengths)
        try:
            logits = self._prompt_forward(ids, embeds, cache, kwargs, last=[n - 1 for n in lengths])
            for layer in cache:
                if isinstance(layer, RaggedStateCache):
                    layer.write_back()
            return logits
        except Exception:
            for layer in cache:
                layer.rollback()
            self._pieces_work = False
            log.warning(
                "%s: prefilling several prompts' pieces in one forward failed; pieces go one at a time",
                self.info.model_type,
                exc_info=True,
            )
            raise

    @staticmethod
    def _pieces_caches(states: list[PromptState], lengths: list[int]) -> list[Any]:
        """A layer cache each over the rows' own caches, for a pieces forward (ragged_cache.py)."""
        return [
            (RaggedStateCache if kv_caches.is_state(rows[0]) else RaggedLayerCache)(list(rows), lengths)
            for rows in zip(*(st.cache for st in states))
        ]

    def _stacked_inputs(
        self, states: list[PromptState], spans: list[tuple[int, int]], width: int, left: bool
    ) -> tuple[mx.array, mx.array, dict]:
        """Prompt positions [start, end) of each row, padded to `width` on the left (a batch that
        ends together) or the right (pieces that start where each row is): ids, embeddings, and
        the language model's other per-position inputs."""

        def rows_of(arrays, axis):
            # Always a fresh row-contiguous array: kernels are compiled per memory layout too, and a
            # lone broadcast or sliced view would miss the ones warm-up compiled.
            out = []
            for x, (s, e) in zip(arrays, spans):
                x = x[..., s:e] if axis == x.ndim - 1 else x[:, s:e]
                widths = [(0, 0)] * x.ndim
                widths[axis] = (width - (e - s), 0) if left else (0, width - (e - s))
                out.append(mx.pad(x, widths) if e - s < width else x)
            return mx.contiguous(mx.concatenate(out, axis=axis - 1 if axis == 2 else 0))

        ids = rows_of([st.input_ids for st in states], 1)
        embeds = rows_of([st.embeds for st in states], 1)
        kwargs = {}
        if states[0].position_ids is not None:
            # Text-only rows carry (1, L) positions, image rows (3, 1, L) M-RoPE ones.
            pos = [
                st.position_ids
                if st.position_ids.ndim == 3
                else mx.broadcast_to(st.position_ids[None], (3, *st.position_ids.shape))
                for st in states
            ]
            kwargs["position_ids"] = rows_of(pos, 2)
        rows = [self._mask_rows(st, s, e) for st, (s, e) in zip(states, spans)]
        if any(r is not None for r in rows):
            masks = [
                st.extra[_TOKEN_MASK] if r is not None else mx.zeros(st.input_ids.shape, dtype=mx.bool_)
                for st, r in zip(states, rows)
            ]
            kwargs[_TOKEN_MASK] = rows_of(masks, 1)
            # Batch-major, as the model's deepstack step takes them row by row.
            kwargs[_MASK_ROWS] = [
                mx.concatenate([r[layer] for r in rows if r is not None], axis=0)
                for layer in range(len(next(r for r in rows if r is not None)))
            ]
        for k in _PER_POSITION & states[0].extra.keys():
            kwargs[k] = rows_of([st.extra[k] for st in states], 1)
        return ids, embeds, kwargs

    # ---- batched decode ------------------------------------------------------
    def kv_layout(self) -> tuple[int, tuple[int, int, int], Any]:
        """(layers, (kv_heads, key_dim, value_dim), dtype) of the KV cache (its plain KV layers
        only, where others hold fixed-size state: `state_layout`), read off a one-token forward."""
        if self._kv_layout is None:
            caches = self._one_token_caches()
            kv = kv_caches.kv_layers(caches)
            k, v = kv[0].state
            self._kv_layout = (len(kv), (k.shape[1], k.shape[3], v.shape[3]), k.dtype)
            self._state_layout = [
                [(tuple(a.shape[1:]), a.dtype) for a in c.state] if kv_caches.is_state(c) else None for c in caches
            ]
        return self._kv_layout

    def state_layout(self) -> list[list[tuple[tuple[int, ...], Any]] | None]:
        """Per layer of the language model: None where its cache is KV, else the shape past the
        row axis and the dtype of each array of its fixed-size state (a convolution window, a
        recurrent state), read off the same forward as `kv_layout`."""
        self.kv_layout()
        return self._state_layout

    def _one_token_caches(self) -> list[Any]:
        cache = vlm_cache.make_prompt_cache(self.language_model)
        kwargs = {"position_ids": mx.zeros((3, 1, 1), dtype=mx.int32)} if self.uses_mrope else {}
        try:
            self.language_model(mx.zeros((1, 1), dtype=mx.int32), cache=cache, **kwargs)
        finally:
            self._forget_positions()
        return cache

    def merge_caches(self, caches: list[list[Any]]) -> list[Any]:
        """Per-request caches -> one batch cache per layer (left-padded); a lone request of a model
        that cannot batch keeps its own."""
        if not self.can_batch:
            if len(caches) != 1:
                raise NotImplementedError(f"{self.info.model_type}: its caches cannot be batched")
            return caches[0]
        return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]

    def decode_positions(self, rows: list[Any]) -> mx.array | None:
        """Each row's M-RoPE position for its next token (0 for an empty slot); None without M-RoPE.
        A row is anything with `cache_len` and `prompt.position_offset` (None: an empty slot)."""
        if not self.uses_mrope:
            return None
        return mx.array([0 if r is None else r.cache_len + r.prompt.position_offset for r in rows], dtype=mx.int32)

    def decode(self, tokens: mx.array, batch_cache: list[Any], positions: mx.array | None) -> mx.array:
        """One step for every running row: tokens (B,), positions (B,) for M-RoPE; returns logits (B, V)."""
        kwargs = {}
        if positions is not None:
            kwargs["position_ids"] = mrope_decode_positions(positions)
        if self.prefix_lm:  # the model makes no mask of its own: keep each row to its own KV
            kwargs["mask"] = batch_cache[0].make_mask(1, return_array=True)
        out = self.language_model(tokens[:, None], cache=batch_cache, **kwargs)
        return out.logits[:, -1, :]


def mrope_decode_positions(positions: mx.array) -> mx.array:
    """(B,) next positions -> the (3, B, 1) M-RoPE position ids of a one-token step (text: all three equal)."""
    pos = positions.reshape(1, -1, 1)
    return mx.broadcast_to(pos, (3, pos.shape[1], 1))
