"""CPU preprocessing on a bounded thread pool: chat template, images, tokenization.

Produces a PreparedRequest holding token ids and NumPy arrays only; the MLX worker turns
them into mx.arrays. Nothing here runs on the event loop or on the MLX thread. What differs by
model family (a faster processor twin, where the resize cap applies, which inputs may ship as
bfloat16) comes from the model's ProcessorAdapter (models/registry.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import io
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from PIL import Image

from vlmserve.config import ServerConfig
from vlmserve.inputs.limits import check_context, check_text_length
from vlmserve.inputs.media import FetchCancel, ImageCache, MediaError, MediaPolicy, load_image_bytes
from vlmserve.inputs.media.hosts import HostSlots, remote_host
from vlmserve.models.base import ProcessorAdapter
from vlmserve.models.pixels import cast_pixels, image_bytes
from vlmserve.models.processor import plain_prompt
from vlmserve.models.registry import processor_adapter
from vlmserve.object_memo import ObjectMemo
from vlmserve.protocol import ChatMessage, ChatRequest, EngineError, ImageRef, PreparedRequest, SamplingParams

log = logging.getLogger(__name__)


def media_policy(config: ServerConfig) -> MediaPolicy:
    return MediaPolicy(
        fetch_timeout=config.image_fetch_timeout,
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        allowed_hosts=tuple(config.allowed_image_hosts),
        local_files_root=config.allow_local_image_files,
        allowed_domains=tuple(config.allowed_media_domains),
    )


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Internal messages -> the content-part form that VLM chat templates expect. A text part
    carries its text under both keys templates read (`text`, and `content` as mlx-vlm's own
    message builder writes it, and some templates read only that one). Tool results and
    assistant turns that called tools carry their text as a string (tool templates print it),
    and earlier calls with their arguments as objects (templates serialise them)."""
    out = []
    for msg in messages:
        role = "system" if msg.role == "developer" else msg.role
        content: Any = [
            {"type": "text", "text": p, "content": p} if kind == "text" else {"type": "image"} for kind, p in msg.parts
        ]
        if role == "tool" or msg.tool_calls:
            content = "".join(p for kind, p in msg.parts if kind == "text")
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.tool_calls:
            entry["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": _arguments(c)}}
                for c in msg.tool_calls
            ]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            entry["name"] = msg.name
        out.append(entry)
    return out


def _arguments(call: dict) -> Any:
    try:
        return json.loads(call["arguments"])
    except ValueError:
        return call["arguments"]


# Shared decoded images come back every turn of an image chat: hash each once.
_HASHES = ObjectMemo(max_entries=256, max_bytes=512 << 20, size=lambda image, _: image_bytes(image))


def image_hash(image: Image.Image) -> str:
    """An image's content as the processor gets it (mode, size, pixels): the same picture sent
    twice, by URL or inline, hashes the same; any other pixel does not."""

    def compute() -> str:
        digest = hashlib.blake2b(f"{image.mode}:{image.width}x{image.height}:".encode(), digest_size=16)
        digest.update(image.tobytes())
        return digest.hexdigest()

    return _HASHES.get(image, None, compute)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it names no file."""
    if not value:
        return None
    try:
        if len(value) < 4096 and Path(value).expanduser().is_file():
            return Path(value).expanduser().read_text()
    except OSError:  # not a usable path (e.g. a long template): the value is the template
        pass
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value[:80]!r} is neither a file nor a Jinja template")
    return value


def warmup_chats(image_sizes) -> list[tuple[str, ChatRequest]]:
    """Warm-up's requests: a text one and one per square image size, as PNG data URIs, so they
    take the same fetch/decode/process path as a client's."""
    jobs = [("warmup-text", [("text", "Hello")])]
    for size in image_sizes:
        buf = io.BytesIO()
        Image.new("RGB", (size, size), (127, 127, 127)).save(buf, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        jobs.append((f"warmup-image-{size}", [("image", ImageRef(uri, "warmup")), ("text", "Hi")]))
    return [
        (name, ChatRequest([ChatMessage("user", parts)], SamplingParams(max_tokens=2, temperature=0)))
        for name, parts in jobs
    ]


class Preprocessor:
    def __init__(
        self,
        processor,
        context_length: int,
        config: ServerConfig,
        pixel_dtype: str | None = None,
        model_type: str | None = None,
        whole_prefixes: bool = False,
    ):
        """`model_type` (ModelInfo.model_type) picks the family's ProcessorAdapter; None: the generic
        one. `whole_prefixes` (ModelInfo's): requests get their `turn_prefix`."""
        self.config = config
        self.whole_prefixes = whole_prefixes
        self.context_length = context_length
        self.pixel_dtype = pixel_dtype  # ModelInfo.pixel_dtype: ship pixel_values already cast
        self.adapter: ProcessorAdapter = processor_adapter(model_type or "")
        self.processor = self.adapter.prepare_processor(processor, pixel_dtype, config.max_pixels)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        # Some processors keep the chat template on their tokenizer only.
        self.template_owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        self.chat_template: str | None = load_chat_template(config.chat_template) or getattr(
            self.template_owner, "chat_template", None
        )
        try:  # the longest vocabulary entry bounds the characters one token covers (check_text_length)
            self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=0)
        except (AttributeError, TypeError, NotImplementedError):
            self.max_token_chars = 0
        call = getattr(self.processor, "process", self.processor)
        self._takes_special_tokens_flag = "add_special_tokens" in inspect.signature(call).parameters
        self.policy = media_policy(config)
        self.images = ImageCache(max_entries=config.image_cache_entries)
        self.pool = ThreadPoolExecutor(config.preprocess_workers, thread_name_prefix="preprocess")
        self.fetch_workers = max(4, config.preprocess_workers * 2)
        self.fetch_pool = ThreadPoolExecutor(self.fetch_workers, thread_name_prefix="fetch")
        self.host_slots = HostSlots(max(1, self.fetch_workers // 2))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)

    async def fetch_images(self, chat: ChatRequest) -> list[Image.Image]:
        """Fetch + decode a request's images concurrently; the image count was checked when the
        request was parsed (limits.check_image_count).

        Remote images are fetched on the fetch pool, at most half of it per host, so a slow or
        hanging image server can hold neither a preprocessing worker nor the whole fetch pool.
        Inline images (data: URIs, bare base64, allowed local files) never wait behind remote
        ones: they are decoded on the CPU pool. When one image fails, or the client leaves, the
        request's fetches that have not started never do, and those running are stopped."""
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(self._fetch_one(loop, ref)) for ref in chat.images]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    async def _fetch_one(self, loop: asyncio.AbstractEventLoop, ref: ImageRef) -> Image.Image:
        host = remote_host(ref.url)
        if host is None:
            return await loop.run_in_executor(self.pool, self._load_image, ref)
        cancel = FetchCancel()
        async with self.host_slots.slot(host):
            try:
                return await loop.run_in_executor(self.fetch_pool, self._load_image, ref, cancel)
            except asyncio.CancelledError:  # the request failed or its client left: stop the fetch now
                cancel.cancel()
                raise

    # ---- pool threads ------------------------------------------------------------
    def render(self, chat: ChatRequest) -> str:
        if chat.raw_prompt:
            return "".join(p for m in chat.messages for kind, p in m.parts if kind == "text")
        template_messages = to_template_messages(chat.messages)
        if not self.chat_template:
            return plain_prompt(self.processor, template_messages)  # a prompt-only model
        try:
            return self._apply_template(chat, template_messages)
        except jinja2.TemplateError as exc:  # the template refuses these messages (raise_exception)
            raise EngineError(
                f"the model's chat template rejected these messages: {exc}", code="invalid_messages", param="messages"
            ) from None

    def _apply_template(self, chat: ChatRequest, template_messages: list[dict[str, Any]]) -> str:
        extra = {}
        if chat.tools and chat.tool_choice != "none":
            extra["tools"] = [{"type": "function", "function": t} for t in chat.tools]
        return self.template_owner.apply_chat_template(
            template_messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False, **extra
        )

    def turn_prefix(self, chat: ChatRequest, prompt: str, ids: np.ndarray) -> int:
        """The positions of `ids` (of `prompt`, rendered from `chat`) that the prompt of the
        chat's next turn starts with, where fewer than all: templates of thinking models end the
        generation prompt with the opening of the thinking, which the next turn's history does
        not hold (it renders the answer without it). 0: all of them, or not known.

        The next turn is rendered with a stand-in answer and question; the text after the two
        renderings part must be the prompt's last tokens, tokenized alone."""
        if chat.raw_prompt or not self.chat_template:
            return 0
        after = [ChatMessage(role="assistant", parts=[("text", "A")]), ChatMessage(role="user", parts=[("text", "B")])]
        try:
            following = self._apply_template(chat, to_template_messages(chat.messages + after))
        except Exception:  # noqa: BLE001 - a template that refuses the stand-in turn: nothing known
            return 0
        tail = prompt[len(os.path.commonprefix([prompt, following])) :]
        if not tail:
            return 0
        try:
            tail_ids = list(self.tokenizer(tail, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a tokenizer that will not take the text alone: nothing known
            log.debug("turn_prefix: the tokenizer refused the prompt's tail %r", tail, exc_info=True)
            return 0
        n = len(tail_ids)
        if not 0 < n < len(ids) or ids[-n:].tolist() != tail_ids:
            log.debug("turn_prefix: the prompt's tail %r is not its last tokens alone", tail)
            return 0
        return len(ids) - n

    def check_text_length(self, chat: ChatRequest) -> None:
        """400 when the text alone cannot fit the context (limits.check_text_length)."""
        check_text_length(chat, self.context_length, self.max_token_chars)

    def prepare_sync(self, chat: ChatRequest) -> PreparedRequest:
        """Both stages from one thread, for callers outside an event loop (preprocessing
        processes, tools, tests). Like fetch_images, it takes the request's image count as
        checked: a caller building requests itself checks it with limits.check_image_count."""
        return self.encode_chat(chat, list(self.fetch_pool.map(self._load_image, chat.images)))

    def encode_chat(self, chat: ChatRequest, images: list[Image.Image]) -> PreparedRequest:
        """A request's PreparedRequest; 400 (context_length_exceeded) if it cannot fit the context."""
        if chat.min_pixels or chat.max_pixels:
            images = [self.adapter.fit_pixels(im, chat.min_pixels, chat.max_pixels) for im in images]
        prompt = self.render(chat)
        prepared = self.encode(prompt, images)
        check_context(chat, prepared.num_prompt_tokens, self.context_length)
        if self.whole_prefixes:
            prepared.turn_prefix = self.turn_prefix(chat, prompt, prepared.prompt_ids)
        return prepared

    def encode(self, prompt: str, images: list[Image.Image]) -> PreparedRequest:
        if not images:  # as mlx_vlm.prepare_inputs: a text-only prompt needs only the tokenizer
            enc = self.tokenizer([prompt], add_special_tokens=self._add_special_tokens(prompt), return_tensors="np")
            return PreparedRequest(prompt_ids=np.asarray(enc["input_ids"], dtype=np.int32).reshape(-1))
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "np"}
        if self._takes_special_tokens_flag:  # others forward unknown kwargs to the image processor, which rejects them
            kwargs["add_special_tokens"] = self._add_special_tokens(prompt)
        kwargs["images"] = images
        try:
            enc = self.processor(**kwargs)
        except ValueError as exc:  # the image processor rejects some images (e.g. an extreme aspect ratio)
            raise EngineError(
                f"an image could not be processed: {exc}", code="invalid_image", param="messages"
            ) from None
        except (IndexError, KeyError, TypeError) as exc:  # e.g. the text itself holds the image placeholder
            raise EngineError(
                f"the model's processor could not match the text to its images ({type(exc).__name__}: {exc}); "
                "does the text contain the model's image placeholder?",
                code="invalid_prompt",
                param="messages",
            ) from None
        ids = np.asarray(enc["input_ids"], dtype=np.int32).reshape(-1)
        inputs = {
            k: np.asarray(v) for k, v in enc.items() if k not in ("input_ids", "attention_mask") and v is not None
        }
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.dtype == np.float32:
            # The cast happens here, on a pool thread, instead of on the MLX thread; the worker
            # copies half the bytes. Same rounding as the model's own astype, so same values.
            inputs["pixel_values"] = pixels = cast_pixels(pixels, self.pixel_dtype)
        bf16 = frozenset()
        if self.pixel_dtype == "bfloat16":  # pixels (or what the adapter names) as bfloat16 bits
            bf16 = frozenset(k for k in self.adapter.bfloat16_inputs if k in inputs and inputs[k].dtype == np.uint16)
        return PreparedRequest(
            prompt_ids=ids,
            model_inputs=inputs,
            num_images=len(images),
            bfloat16_inputs=bf16,
            image_hashes=tuple(image_hash(im) for im in images) if self.config.mm_cache else (),
        )

    def _add_special_tokens(self, prompt: str) -> bool:
        """Add BOS only when the chat template did not already put it there."""
        bos = getattr(self.tokenizer, "bos_token", None)
        return not (bos and prompt.startswith(bos))

    def _load_image(self, ref: ImageRef, cancel: FetchCancel | None = None) -> Image.Image:
        try:
            data = load_image_bytes(ref.url, self.policy, cancel)
            image = self.images.get_or_decode(data, self.policy)
        except MediaError as exc:
            raise EngineError(exc.message, code=exc.code, param=ref.param) from None
        return self.adapter.cap_image(image, self.config.max_pixels)
