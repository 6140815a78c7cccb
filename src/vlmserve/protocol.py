"""Types shared by every layer: no HTTP, no MLX."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request failed (its input, or a bug)
    UNAVAILABLE = "unavailable"  # the server could not finish it (engine lost, shutdown): retry elsewhere

    @property
    def failed(self) -> bool:
        return self in (FinishReason.ERROR, FinishReason.ABORT, FinishReason.UNAVAILABLE)


@dataclass
class ModelInfo:
    """Plain facts about the loaded model that the CPU side needs (no MLX objects)."""

    path: str
    model_type: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    image_token_id: int | None
    # The dtype the model casts pixel_values to before any arithmetic ("bfloat16", "float16"),
    # where it does: preprocessing may then ship them in it (half the bytes to copy). None: as is.
    pixel_dtype: str | None = None
    # Prefix reuse takes whole cached prompts only (layers that keep state beside their KV), so
    # preprocessing marks where a next turn's prompt parts from each one (turn_prefix).
    whole_prefixes: bool = False


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions: a multiplicative penalty on every token of the prompt and the output
    # (1: off), a floor on a token's probability relative to the likeliest one's (0: off), and
    # the tokens to generate before EOS or a stop token id may come.
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    json_mode: bool = False
    ignore_eos: bool = False  # vLLM extension: benchmarks need exactly max_tokens tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    # An llguidance grammar (its JSON form) the output must match: json_schema outputs, forced tool calls.
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass
class ImageRef:
    """An image part as the client sent it; `param` names it for error messages."""

    url: str
    param: str


@dataclass
class ChatMessage:
    role: str
    # Ordered parts: ("text", str) or ("image", ImageRef)
    parts: list[tuple[str, Any]]
    tool_calls: list[dict] | None = None  # an assistant's calls: [{"id", "type", "function": {name, arguments}}]
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


@dataclass
class ChatRequest:
    messages: list[ChatMessage]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens_requested: bool = False  # the client set max_tokens / max_completion_tokens (not our default)
    tools: list[dict] | None = (
        None  # function definitions the template is shown: [{"name", "description", "parameters"}]
    )
    tool_choice: Any = "auto"  # "none" | "auto" | "required" | a function's name (str, after validation)
    parallel_tool_calls: bool = True
    raw_prompt: bool = False  # /v1/completions: the one message's text is the prompt, no chat template
    echo: str | None = None  # /v1/completions' echo: the prompt text, put before each choice's text
    # mm_processor_kwargs: this request's image size bounds (pixels per image), within the operator's cap.
    min_pixels: int | None = None
    max_pixels: int | None = None

    @property
    def images(self) -> list[ImageRef]:
        return [p for m in self.messages for kind, p in m.parts if kind == "image"]


@dataclass
class PreparedRequest:
    """Output of CPU preprocessing: token ids and NumPy arrays only."""

    prompt_ids: np.ndarray  # int32, shape (L,)
    model_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # pixel_values, image_grid_thw, ...
    num_images: int = 0
    # Names in model_inputs that hold bfloat16 bit patterns as uint16 (NumPy has no bfloat16).
    bfloat16_inputs: frozenset[str] = frozenset()
    # One content hash per image, in prompt order (the pixels as the processor got them): the
    # keys of vision-feature and multimodal prefix reuse. Empty: nothing may be reused by content.
    image_hashes: tuple[str, ...] = ()
    # Where the model reuses only whole cached prompts: the prompt positions a next turn's prompt
    # shares with this one, where fewer than all (the chat template renders that turn's history
    # otherwise than this prompt's generation prompt). 0: all, or not known.
    turn_prefix: int = 0

    @property
    def has_pixels(self) -> bool:
        """The request carries images (in whatever form its model's preprocessing ships them)."""
        return self.num_images > 0 or any(k.startswith("pixel_values") for k in self.model_inputs)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_ids.shape[0])


@dataclass
class CacheGauges:
    """The engine's cache figures, for /metrics."""

    prefix_usage: float | None = None  # share of the prefix cache's token budget in use (None: no cache)
    mm_prefix_usage: float | None = None  # the same for the multimodal prefix cache (None: --no-mm-cache)
    kv_tokens: int = 0  # tokens in the running rows' KV
    kv_blocks_used: int = 0  # KV budget blocks held by admitted rows
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # pool blocks cached prefixes hold (some shared with rows; freed as rows need them)
    preemptions: int = 0  # rows put aside for KV memory since start
    memory: dict[str, int] = field(default_factory=dict)  # MLX's device memory in bytes: active, cache, peak
    feature_queries: int = 0  # vision-feature cache lookups since start (image requests)
    feature_hits: int = 0
    warmup_pending: int = 0  # kernels, prompt piece lengths and kernel filings left after ready


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]


@dataclass
class TokenEvent:
    """One step's output for one request. `text` is the new, stop-checked text."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # An OpenAI error code when the request itself is at fault (answered 400), e.g.
    # context_length_exceeded; None: the server's fault.
    error_code: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class EngineError(Exception):
    """An error to report to the client; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, *, code: str | None = None, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param


def new_request_id(prefix: str = "chatcmpl") -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex[:24]}"
