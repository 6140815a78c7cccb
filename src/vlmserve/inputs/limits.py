"""A request's limits, each checked once on its path and answered in OpenAI's shape.

The image count is checked where the request is parsed (entrypoints), before anything is
fetched or decoded; a text too long for any tokenization before admission; the context after
tokenization (Preprocessor.encode_chat), where the prompt's length is first known.
"""

from __future__ import annotations

from vlmserve.protocol import ChatRequest, EngineError


def check_image_count(chat: ChatRequest, max_images: int) -> None:
    """400 when the request carries more images than --max-images-per-request."""
    count = len(chat.images)
    if count > max_images:
        raise EngineError(
            f"too many images: {count} > {max_images} per request", code="invalid_image", param="messages"
        )


def check_text_length(chat: ChatRequest, context_length: int, max_token_chars: int) -> None:
    """400 before any tokenizing when the messages' text alone must exceed the context: no token
    covers more characters than the vocabulary's longest entry (twice that, for normalizers
    that merge characters), so that many characters need at least this many tokens. A 20 MB
    text is refused in milliseconds instead of being tokenized for a minute."""
    if max_token_chars <= 0:  # the tokenizer's vocabulary is unknown: no bound
        return
    # Assistant turns are left out: templates may drop parts of them (earlier reasoning).
    chars = sum(len(v) for m in chat.messages if m.role != "assistant" for kind, v in m.parts if kind == "text")
    at_least = chars // (2 * max_token_chars)
    if at_least + 1 > context_length:
        raise EngineError(
            f"prompt is at least {at_least} tokens ({chars} characters of text); "
            f"this model's context is {context_length} tokens",
            code="context_length_exceeded",
            param="messages",
        )


def check_context(chat: ChatRequest, prompt_tokens: int, context_length: int) -> None:
    """400 when the prompt leaves no room to generate, or when the client's own max_tokens cannot
    fit after it (as OpenAI and vLLM answer). Our default max_tokens is not the client's ask: that
    generation stops at the context's end."""
    if prompt_tokens + 1 > context_length:
        raise EngineError(
            f"prompt is {prompt_tokens} tokens; this model's context is {context_length} tokens",
            code="context_length_exceeded",
            param="messages",
        )
    asked = chat.sampling.max_tokens
    if chat.max_tokens_requested and prompt_tokens + asked > context_length:
        raise EngineError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the messages, {asked} in the completion). "
            "Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
            param="max_tokens",
        )
