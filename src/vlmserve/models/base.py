"""The ModelAdapter protocol: everything the engine and the preprocessing need to know of a family.

Two halves, so the CPU side never loads MLX work:
- `ProcessorAdapter` (CPU, no MLX): how the family's processor is used on the preprocessing
  pool. The generic class here serves any mlx-vlm processor; a family may override parts.
- `ModelAdapter` (device, MLX worker thread only): embed prompts, prefill, decode. The generic
  implementation is `models/generic.py`; a family's fast path subclasses it.
`models/registry.py` maps a config's model_type to both.
"""

from __future__ import annotations

from typing import Any, Protocol

from PIL import Image

from vlmserve.protocol import ModelInfo, PreparedRequest


class ProcessorAdapter:
    """The CPU half, for any mlx-vlm processor."""

    # Processor outputs that may be shipped as bfloat16 bit patterns (uint16) when the model
    # casts them to bfloat16 first (ModelInfo.pixel_dtype).
    bfloat16_inputs: tuple[str, ...] = ("pixel_values",)
    # The most images one prompt of this family reads (None: any number). Past it a request is
    # refused, never answered with images silently dropped.
    max_images: int | None = None

    def prepare_processor(self, processor, pixel_dtype: str | None, max_pixels: int | None = None):
        """The processor preprocessing calls; a family may swap in a faster twin with the same outputs.

        `max_pixels` (--max-pixels): a family whose processor resizes anyway may apply the cap
        there (one resize) and pass images through `cap_image`; here `cap_image` applies it.
        Called once, by the one preprocessor that owns this adapter."""
        return processor

    def fit_pixels(self, image: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
        """A request's own bounds (mm_processor_kwargs): scale, keeping the aspect ratio, so that
        min_pixels <= width*height <= max_pixels; the processor's own resizing follows."""
        area = image.width * image.height
        target = (
            max_pixels if max_pixels and area > max_pixels else min_pixels if min_pixels and area < min_pixels else 0
        )
        if not target:
            return image
        scale = (target / area) ** 0.5
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)

    def cap_image(self, image: Image.Image, max_pixels: int | None) -> Image.Image:
        """Operator resize cap: shrink (never grow) so that width*height <= max_pixels."""
        if not max_pixels or image.width * image.height <= max_pixels:
            return image
        scale = (max_pixels / (image.width * image.height)) ** 0.5
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)


class ModelAdapter(Protocol):
    """The device half. Runs on the MLX worker thread only."""

    info: ModelInfo
    model: Any
    language_model: Any
    # The prompt attends to itself bidirectionally (a prefix LM): prefilled in one piece, and
    # never from or into the token-keyed prefix cache.
    prefix_lm: bool
    # Its per-request caches merge into a batch cache (mlx-lm's `merge`); else one row at a time.
    can_batch: bool

    def stage_inputs(self, prepared: PreparedRequest) -> dict[str, Any]:
        """A request's arrays copied into MLX now, ahead of its embedding."""

    def embed_prompts(self, prepared: list[PreparedRequest], staged: list[dict | None] | None = None) -> list[Any]:
        """Embed several prompts (vision tower + merge); one PromptState each."""

    # Whether a prompt's first token may come from the prefill forward that runs its last position
    # with those before it (else that position rides the first decode step, as mlx_vlm.generate runs it).
    samples_in_prefill: bool

    def prefill(self, state: Any, start: int, end: int) -> Any:
        """Run prompt positions [start, end) into the request's own cache; the last one's logits (1, V)."""

    def prefill_batch(self, states: list[Any], lengths: list[int], bucket: int = 1) -> tuple[list[Any], Any]:
        """Prefill several prompts in one left-padded forward; their batch cache, and each one's
        last logits (rows, V)."""

    # Whether `prefill_pieces` serves (plain KV caches, or those and fixed-size state, causal
    # attention, a forward that takes it).
    prefills_pieces: bool

    def prefill_pieces(
        self, states: list[Any], spans: list[tuple[int, int]], bucket: int = 1, caches: list | None = None
    ) -> Any:
        """Prefill positions [start, end) of several prompts in one forward, each into its own
        cache, or into `caches` (one per layer over these rows, their KV in the block pool);
        each piece's last logits (rows, V)."""

    def kv_layout(self) -> tuple[int, tuple[int, int, int], Any]:
        """(layers, (kv_heads, key_dim, value_dim), dtype) of the KV cache (its KV layers)."""

    def state_layout(self) -> list[Any]:
        """Per language-model layer: None for a KV layer, else the (shape past the row axis,
        dtype) of each array of its fixed-size state (convolution window, recurrent state)."""

    def merge_caches(self, caches: list[list[Any]]) -> list[Any]:
        """Per-request caches -> one batch cache per layer."""

    def decode_positions(self, rows: list[Any]) -> Any:
        """Each row's position for its next token, or None where the model derives it from the cache."""

    def decode(self, tokens: Any, batch_cache: list[Any], positions: Any) -> Any:
        """One step for every running row; returns logits (B, V)."""

    def kernels_pending(self) -> int:
        """Kernel builds left for the engine: warm-up runs them (0: none)."""
        ...

    def build_next_kernel(self) -> None:
        """Build (and check) one of them; the op it replaces serves until then."""
        ...

    def idle_warmups_pending(self) -> int:
        """Shapes the model runs once while the engine is idle after ready, so traffic does not
        meet them first (0: none)."""
        ...

    def warm_next_idle(self) -> None:
        """Run one of them."""
        ...

    def attention_plans_pending(self) -> int:
        """Attention shapes met without a cuDNN plan (a plan-free kernel served them), whose
        plans the engine builds while idle (0: none)."""
        ...

    def attention_plan_due(self) -> bool:
        """Whether one of them recurs enough to be built between two steps of a busy engine."""
        ...

    def build_next_attention_plan(self, hot: bool = False) -> None:
        """Build one of those plans (`hot`: the one due); that shape goes to cuDNN from the next call on."""
        ...

    def row_memory(self) -> tuple[int, int] | None:
        """A request's caches on the device: bytes per position and fixed bytes (recurrent
        state); None where they cannot be counted (the KV budget of an unpaged model)."""
        ...

    def warm_vision(self, prepared: PreparedRequest, max_images: int) -> int:
        """Build the vision tower's shapes for this request's image sizes at up to `max_images`
        images per call; returns the tower runs made (0 where nothing needs building)."""
