"""OpenAI Chat Completions requests: a JSON body validated into a ChatRequest (protocol.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import llguidance

from vlmserve.config import ServerConfig
from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.inputs.limits import check_image_count
from vlmserve.models.tool_calls import COMPACT_JSON
from vlmserve.protocol import ChatMessage, ChatRequest, ImageRef, SamplingParams

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
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


def _flag(body: dict, key: str, default: bool) -> bool:
    """A boolean field; an explicit null is unset (some proxies send nulls for unset fields)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", key)
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
        message = ChatMessage(role=role, parts=_parse_content(msg.get("content"), i, role))
        if role == "assistant" and msg.get("tool_calls") is not None:
            message.tool_calls = _parse_tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool message needs 'tool_call_id'", f"messages[{i}].tool_call_id")
            message.tool_call_id = call_id
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad("'name' must be a string", f"messages[{i}].name")
        message.name = name
        out.append(message)
    return out  # a conversation with no user turn is the chat template's to accept or refuse


def _parse_tool_calls(value: Any, param: str) -> list[dict]:
    """An assistant message's earlier calls, as the template will be shown them."""
    if not isinstance(value, list):
        raise _bad("'tool_calls' must be an array", param)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("each tool call needs 'function.name'", f"{param}[{j}]")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise _bad("'function.arguments' must be a JSON string", f"{param}[{j}].function.arguments")
        calls.append({"id": call.get("id") or f"call_{j}", "name": fn["name"], "arguments": arguments})
    return calls


def parse_tools(body: dict) -> tuple[list[dict] | None, Any, bool]:
    """(function definitions, tool_choice, parallel_tool_calls) from a request body."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise _bad(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
        functions = []
        for j, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _FUNCTION_NAME.match(fn["name"]):
                raise _bad("each tool must be {'type': 'function', 'function': {'name': ...}}", f"tools[{j}]")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise _bad("'function.parameters' must be a JSON Schema object", f"tools[{j}].function.parameters")
            functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
        tools = functions or None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not any(t["name"] == name for t in tools or []):
            raise _bad("'tool_choice' names no function in 'tools'", "tool_choice")
        choice = {"name": name}
    elif choice not in ("none", "auto", "required"):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or a function", "tool_choice")
    elif choice == "required" and not tools:
        raise _bad("'tool_choice' 'required' needs 'tools'", "tool_choice")
    return tools, choice, _flag(body, "parallel_tool_calls", True)


MIN_IMAGE_PIXELS = 28 * 28  # smaller bounds are no image at all to a vision tower


def parse_pixel_bounds(value: Any, operator_cap: int | None, image_limit: int) -> tuple[int | None, int | None]:
    """vLLM's per-request `mm_processor_kwargs`: `min_pixels` / `max_pixels` per image, both
    within the operator's --max-pixels, or without one within the largest image a request may
    send (--max-image-pixels): a larger request is held to it, so a small image cannot be
    scaled up past what the server would decode."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or set(value) - {"min_pixels", "max_pixels"}:
        raise _bad("'mm_processor_kwargs' takes 'min_pixels' and 'max_pixels' only", "mm_processor_kwargs")
    hi = min(operator_cap or image_limit, image_limit)
    low, high = (
        _number(value, key, MIN_IMAGE_PIXELS, 1 << 30, None, integer=True) for key in ("min_pixels", "max_pixels")
    )
    if low and high and low > high:
        raise _bad("'min_pixels' must not exceed 'max_pixels'", "mm_processor_kwargs")
    return tuple(None if n is None else min(int(n), hi) for n in (low, high))


def json_schema_grammar(response_format: dict) -> str:
    """`response_format: {"type": "json_schema", "json_schema": {"schema": ...}}` as a grammar."""
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is None and isinstance(spec, dict) and "name" in spec:
        schema = {"type": "object"}  # a name without a schema: any object
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON Schema object", "response_format")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT_JSON)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise _bad(f"unsupported JSON Schema: {problem.splitlines()[0]}", "response_format.json_schema.schema")
    return grammar


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
    min_tokens = int(_number(body, "min_tokens", 0, context_length, 0, integer=True))
    if max_tokens is None:  # a min_tokens past the default raises it (vLLM's chat API takes it alone)
        max_tokens = min(max(config.default_max_tokens, min_tokens), context_length)

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

    stream = _flag(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    include_usage = (stream_options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    include_usage = bool(include_usage) and stream

    response_format = body.get("response_format")
    json_mode, grammar = False, None
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")
        json_mode = kind == "json_object"
        if kind == "json_schema":
            grammar = json_schema_grammar(response_format)
    tools, tool_choice, parallel_tool_calls = parse_tools(body)
    if grammar is not None and (tool_choice == "required" or isinstance(tool_choice, dict)):
        raise _bad("a forced 'tool_choice' cannot be combined with a json_schema 'response_format'", "tool_choice")

    ignore_eos = _flag(body, "ignore_eos", False)
    if ignore_eos and (json_mode or grammar is not None):
        raise _bad("'ignore_eos' cannot be combined with a JSON 'response_format'", "ignore_eos")
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
        repetition_penalty=float(_number(body, "repetition_penalty", 0, 2, 1.0)),
        min_p=float(_number(body, "min_p", 0, 1, 0.0)),
        min_tokens=min_tokens,
        logprobs=bool(logprobs),
        top_logprobs=int(top_logprobs),
        json_mode=json_mode,
        ignore_eos=ignore_eos,
        logit_bias=parse_logit_bias(body.get("logit_bias")),
        grammar=grammar,
    )
    if sampling.top_p == 0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    if sampling.repetition_penalty == 0:
        raise _bad("'repetition_penalty' must be greater than 0", "repetition_penalty")
    if sampling.min_tokens > sampling.max_tokens:
        raise _bad("'min_tokens' must not exceed the requested token limit", "min_tokens")
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if sampling.min_tokens and (json_mode or grammar is not None or forced):
        # the grammar's end is EOS: held back, nothing would be left to draw
        raise _bad(
            "'min_tokens' cannot be combined with a JSON 'response_format' or a forced 'tool_choice'", "min_tokens"
        )
    n = int(_number(body, "n", 1, MAX_N, 1, integer=True))
    min_pixels, max_pixels = parse_pixel_bounds(
        body.get("mm_processor_kwargs"), config.max_pixels, config.max_image_pixels
    )
    chat = ChatRequest(
        messages=messages,
        sampling=sampling,
        n=n,
        stream=stream,
        include_usage=include_usage,
        max_tokens_requested=max_completion is not None or max_legacy is not None,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    limit = config.max_images_per_request if max_images is None else max_images
    check_image_count(chat, limit)  # before fetching or decoding any of them
    return chat
