"""Tool calls in a model's own output format: found in the text, and forced by a grammar (CPU only).

Each format knows how its models write a call, how to read calls back out of generated text,
and (where it can) the llguidance grammar that makes the output exactly one or more valid
calls, for `tool_choice: "required"` or a named function:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes, ...)
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}`
- `llama3_json`: a bare `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`)
- `pythonic`: `[get_weather(city="Paris"), ...]` (Llama 4, Gemma function calling)
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import secrets
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        call = {
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(obj, args_key: str = "arguments", strict: bool = False) -> ToolCall | None:
    """A {"name", "arguments"} object (or "parameters") as a ToolCall; None if it is not one.
    `strict` (output without a call marker): the arguments key must be there, and nothing else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if strict and set(obj) != {"name", args_key} and set(obj) != {"name", "arguments"}:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_at_start(text: str):
    """The JSON value `text` starts with (after whitespace), or None."""
    try:
        return _DECODER.raw_decode(text.lstrip())[0]
    except ValueError:
        return None


_DEFS = ("$defs", "definitions")


def _moved_defs(schema, prefix: str):
    """`schema` with its `$defs` / `definitions` taken out, and its references to them renamed
    under `prefix`: (the schema, the definitions), so a wrapper can hold them at its root."""
    if not isinstance(schema, dict):
        return schema, {}
    defs = {f"{prefix}{k}": v for key in _DEFS for k, v in (schema.get(key) or {}).items()}

    def rename(node):
        if isinstance(node, dict):
            out = {k: rename(v) for k, v in node.items() if k not in _DEFS}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for key in _DEFS:
                    if ref.startswith(f"#/{key}/"):
                        out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3 :]}"
            return out
        if isinstance(node, list):
            return [rename(v) for v in node]
        return node

    return rename(schema), {k: rename(v) for k, v in defs.items()}


def _call_schema(tool: dict, args_key: str, prefix: str = "") -> tuple[dict, dict]:
    params, defs = _moved_defs(tool.get("parameters") or {"type": "object"}, prefix)
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }
    return schema, defs


# JSON as json.dumps writes it: without this, whitespace is free, and a model can spend its
# whole output on it before the call closes.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _calls_schema(tools: list[dict], args_key: str) -> dict:
    """One call to any of `tools`; each tool's definitions held at the root, renamed per tool."""
    parts = [_call_schema(t, args_key, f"t{i}_") for i, t in enumerate(tools)]
    schema = parts[0][0] if len(parts) == 1 else {"anyOf": [s for s, _ in parts]}
    defs = {k: v for _, d in parts for k, v in d.items()}
    return {**schema, **({"$defs": defs} if defs else {}), "x-guidance": COMPACT_JSON}


class ToolParser:
    name = ""
    start: str | None = None  # the text that opens a call; None: the whole output is calls, or not
    args_key = "arguments"

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside calls, the calls); no calls: the text unchanged."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool) -> str | None:
        """An llguidance grammar whose every output is one call (more if `parallel`) to one of
        `tools`, arguments matching their schemas; None where this format has none."""
        return None

    # First characters of an output that may be calls without a marker (a stream holds it back).
    openers: tuple[str, ...] = ()

    @staticmethod
    def _lark(call: dict, head: str, sep: str, tail: str, parallel: bool) -> str:
        more = f" ({json.dumps(sep)} call)*" if parallel else ""
        return f"start: {json.dumps(head)} call{more} {json.dumps(tail)}\ncall: %json {json.dumps(call)}\n"


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.S)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body, closed in self._BLOCK.findall(text):
            call = _call(_json_at_start(body))
            if call is None and not closed and calls:
                break  # the output ran out inside a later call: the complete ones stand
            if call is None:
                return text, []  # not a well-formed call: leave the text as the model wrote it
            calls.append(call)
        return self._BLOCK.sub("", text).strip(), calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        call = _calls_schema(tools, self.args_key)
        return self._lark(call, "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", parallel)


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    openers = ("[",)  # the marker is a special token some detokenizers drop
    _NAMED = re.compile(r"([A-Za-z_][\w.-]*)\s*(?:\[ARGS\])?\s*(?=\{)")

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        head, marker, rest = text.partition(self.start)
        if not marker:  # the marker is a special token some detokenizers drop: a leading call array
            stripped = text.lstrip()
            if not stripped.startswith("[{"):
                return text, []
            head, rest = "", stripped
        rest = rest.strip()
        if rest.startswith("["):
            try:
                value, _ = _DECODER.raw_decode(rest)
            except ValueError:
                return text, []
            strict = not marker  # no marker: only an exact call array is taken for calls
            calls = [_call(v, strict=strict) for v in value] if isinstance(value, list) else []
        else:  # name[ARGS]{...} repeated
            calls, i = [], 0
            while (m := self._NAMED.match(rest, i)) is not None:
                try:
                    args, i = _DECODER.raw_decode(rest, m.end())
                except ValueError:
                    return text, []
                calls.append(_call({"name": m.group(1), "arguments": args}))
                while i < len(rest) and rest[i] in " \n,":
                    i += 1
        if not calls or any(c is None for c in calls):
            return text, []
        return head.strip(), calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return self._lark(_calls_schema(tools, self.args_key), "[TOOL_CALLS][", ", ", "]", parallel)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, i = [], 0
        while i < len(body):  # calls separated by ";"
            try:
                value, i = _DECODER.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(value, self.args_key, strict=True)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[i:].lstrip()
            if rest and not rest.startswith(";"):
                return text, []
            i = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return "", calls

    openers = ("{", "<")

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return self._lark(_calls_schema(tools, self.args_key), "", "; ", "", parallel)


class PythonicParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return text, []
            try:  # literals only; a value JSON cannot hold (sets, bytes, odd keys) is no call
                args = {kw.arg: ast.literal_eval(_python_literals(kw.value)) for kw in node.keywords if kw.arg}
                arguments = json.dumps(args, ensure_ascii=False)
                arguments.encode("utf-8")  # lone surrogates from escapes
            except (ValueError, TypeError, RecursionError, UnicodeEncodeError):
                return text, []
            calls.append(ToolCall(ast.unparse(node.func), arguments))
        return "", calls

    openers = ("[", "<")

    def grammar(self, tools: list[dict], parallel: bool) -> str | None:
        """`[name(key=value, ...)]`: each tool's required arguments in order, then its optional
        ones (each may be left out, with those after it); values as JSON, which the parser reads
        back (JSON's true/false/null included)."""
        lines, calls = [], []
        for t, tool in enumerate(tools):
            params, defs = _moved_defs(tool.get("parameters") or {}, "")
            props = params.get("properties") or {}
            if not all(_python_name(n) for n in [*props, *tool["name"].split(".")]):
                return None  # names a Python call cannot spell: the model is asked, not forced
            required = [k for k in params.get("required", []) if k in props]
            optional = [k for k in props if k not in required]
            values = {k: f"v{t}_{i}" for i, k in enumerate(required + optional)}
            for k, rule in values.items():
                prop = props[k] if isinstance(props[k], dict) else {}  # `true`: any value
                schema = {**prop, **({"$defs": defs} if defs else {}), "x-guidance": COMPACT_JSON}
                lines.append(f"{rule}: %json {json.dumps(schema)}")
            arg = {k: f'"{k}=" {values[k]}' for k in values}
            body = ' ", " '.join(arg[k] for k in required)
            tail = ""
            for i, k in reversed(list(enumerate(optional))):  # nested: each only after the ones before it
                sep = '", " ' if body or i else ""
                tail = f"({sep}{arg[k]} {tail})?"
            calls.append(f"call{t}")
            lines.append(f'call{t}: {json.dumps(tool["name"] + "(")} {body} {tail} ")"')
        more = ' ("," " " call)*' if parallel else ""
        return "\n".join([f'start: "[" call{more} "]"', "call: " + " | ".join(calls), *lines]) + "\n"


def _python_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _python_literals(node: ast.AST) -> ast.AST:
    """JSON's true/false/null as Python's True/False/None (a grammar writes values as JSON)."""
    names = {"true": True, "false": False, "null": None}

    class Literals(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.AST:
            return ast.Constant(names[name.id]) if name.id in names else name

    return Literals().visit(node)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser, PythonicParser)
}


def detect(template: str | None) -> str:
    """The format a chat template's tool instructions ask for (hermes when it does not say)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "<|python_start|>" in template:
        return "pythonic"
    return "hermes"


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tool definitions at all."""
    return bool(template) and "tools" in template
