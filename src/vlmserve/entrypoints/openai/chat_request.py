"""OpenAI Chat Completions requests: a JSON body validated into a ChatRequest (protocol.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.config import ServerConfig
from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.inputs.limits import check_image_count
from vlmserve.protocol import ChatMessage, ChatRequest, ImageRef, SamplingParams

_ROLES = {"system", "developer", "user", "assistant"}
MAX_N = 128  # OpenAI's limit; --max-waiting bounds it too (Admission)
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # OpenAI's int64, plus the unsigned range
SEED_MOD = 1 << 64  # the engine's PRNG takes an unsigned 64-bit seed


def model_aliases(config: ServerConfig) -> set[str]:
    """Names a request may use: the served name, and the name derived from the model directory."""
    names = {config.model_id}
    path = Path(config.model)
    names.add(path.name if path.exists() else config.model)
    return {n for n in names if n}


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index` of a seeded request samples with its own, reproducible seed."""
    return None if seed is None else (seed + index) % SEED_MOD


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: dict, key: str, lo: float, hi: float, default: float | None, *, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)  # 1.0 is an integer in JSON's number model (JavaScript clients send it)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _bad(f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if not lo <= value <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def _parse_content(content: Any, i: int, role: str) -> list[tuple[str, Any]]:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return [("text", content)]
    if content is None and role == "assistant":
        return []
    if not isinstance(content, list):
        raise _bad("message content must be a string or a list of content parts", param)
    parts: list[tuple[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad("each content part must be an object with a 'type'", p)
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad("text part needs a string 'text'", p)
            parts.append(("text", part["text"]))
        elif kind == "image_url":
            if role != "user":
                raise _bad("image parts are only allowed in user messages", p)
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str) or not url:
                raise _bad("image_url part needs 'image_url.url'", p, "invalid_image_url")
            parts.append(("image", ImageRef(url=url, param=p)))
        else:
            raise _bad(f"unsupported content part type '{kind}'", p)
    return parts


def parse_messages(messages: Any) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"unsupported role {role!r}; use one of {sorted(_ROLES)}", f"messages[{i}].role")
        if "content" not in msg and role != "assistant":
            raise _bad("message needs 'content'", f"messages[{i}].content")
        out.append(ChatMessage(role=role, parts=_parse_content(msg.get("content"), i, role)))
    return out  # a conversation with no user turn is the chat template's to accept or refuse


MAX_LOGIT_BIAS = 1024  # entries per request


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}; sorted (token, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad(f"'logit_bias' values must be numbers between -100 and 100, got {bias!r}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP or not all(isinstance(s, str) for s in value):
        raise _bad(f"'stop' must be a string or an array of at most {MAX_STOP} strings", "stop")
    return tuple(s for s in value if s)


def parse_chat_request(
    body: Any, config: ServerConfig, model_names: set[str], context_length: int, max_images: int | None = None
) -> ChatRequest:
    """A request body -> ChatRequest, or a 400/404: APIError, or EngineError (limits.py) past the image
    count (`max_images`, default --max-images-per-request: the server passes the model's own limit too)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    if model not in model_names:
        raise APIError(404, f"The model '{model}' does not exist", code="model_not_found", param="model")
    messages = parse_messages(body.get("messages"))

    # Both are validated; the newer `max_completion_tokens` wins when both are sent.
    max_completion = _number(body, "max_completion_tokens", 1, context_length, None, integer=True)
    max_legacy = _number(body, "max_tokens", 1, context_length, None, integer=True)
    max_tokens = max_completion if max_completion is not None else max_legacy
    if max_tokens is None:
        max_tokens = min(config.default_max_tokens, context_length)

    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    top_logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
    if top_logprobs and not logprobs:
        raise _bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")

    seed = body.get("seed")
    if isinstance(seed, float) and seed.is_integer() and abs(seed) < 2**63:
        seed = int(seed)  # a whole number sent as a float, as for the other integer fields
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise _bad(f"'seed' must be between {SEED_MIN} and {SEED_MAX}", "seed")
    if seed is not None:
        seed %= SEED_MOD  # negative int64 seeds map onto the unsigned range, deterministically

    stream = body.get("stream")
    stream = False if stream is None else stream  # some proxies send explicit nulls for unset fields
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    include_usage = (stream_options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    include_usage = bool(include_usage) and stream

    response_format = body.get("response_format")
    json_mode = False
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object"):
            raise _bad("'response_format.type' must be 'text' or 'json_object'", "response_format")
        json_mode = kind == "json_object"

    ignore_eos = body.get("ignore_eos", False)
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    if ignore_eos and json_mode:
        raise _bad("'ignore_eos' cannot be combined with response_format 'json_object'", "ignore_eos")
    top_k = int(_number(body, "top_k", -1, 1 << 20, 0, integer=True))
    sampling = SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(_number(body, "temperature", 0, 2, 1.0)),
        top_p=float(_number(body, "top_p", 0, 1, 1.0)),
        top_k=max(top_k, 0),  # -1 (vLLM's "off") == 0
        seed=seed,
        stop=parse_stop(body.get("stop")),
        presence_penalty=float(_number(body, "presence_penalty", -2, 2, 0.0)),
        frequency_penalty=float(_number(body, "frequency_penalty", -2, 2, 0.0)),
        logprobs=bool(logprobs),
        top_logprobs=int(top_logprobs),
        json_mode=json_mode,
        ignore_eos=ignore_eos,
        logit_bias=parse_logit_bias(body.get("logit_bias")),
    )
    if sampling.top_p == 0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    n = int(_number(body, "n", 1, MAX_N, 1, integer=True))
    chat = ChatRequest(
        messages=messages,
        sampling=sampling,
        n=n,
        stream=stream,
        include_usage=include_usage,
        max_tokens_requested=max_completion is not None or max_legacy is not None,
    )
    limit = config.max_images_per_request if max_images is None else max_images
    check_image_count(chat, limit)  # before fetching or decoding any of them
    return chat
