#!/usr/bin/env python3
"""How long the first request using each API feature takes on a warm server, against its second.

A feature whose first use builds something on the engine's thread (a GPU kernel, a tokenizer)
shows as a first request much slower than the second, and while it builds every running
stream waits. Each case is sent twice, one request at a time, after the server reports itself
fully warm (`vlmserve:warmup_pending` 0). With `--kernel-cache` (MLX_PTX_CACHE_DIR of the
server), the kernel modules each first request added are listed too.

    python benchmarks/first_use_probe.py --url http://127.0.0.1:8100 --out first_use.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CASES: list[tuple[str, dict]] = [
    ("greedy", {"temperature": 0}),
    ("temperature", {"temperature": 0.8}),
    ("top_p", {"temperature": 0.8, "top_p": 0.9}),
    ("top_k", {"temperature": 0.8, "top_k": 20}),
    ("min_p", {"temperature": 0.8, "min_p": 0.1}),
    ("penalties", {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5}),
    ("repetition_penalty", {"temperature": 0.8, "repetition_penalty": 1.2}),
    ("logit_bias", {"temperature": 0.8, "logit_bias": {"100": 5, "200": -100}}),
    ("logprobs", {"temperature": 0.8, "logprobs": True, "top_logprobs": 5}),
    ("seed", {"temperature": 0.8, "seed": 7}),
    ("n=2", {"temperature": 0.8, "n": 2}),
    ("json_object", {"response_format": {"type": "json_object"}}),
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}}}),
    ("tool_choice", {"tools": [_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
]


def wait_warm(client: httpx.Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = [x for x in client.get("/metrics").text.splitlines() if x.startswith("vlmserve:warmup_pending")]
        if pending and float(pending[0].split()[-1]) == 0:
            return
        time.sleep(0.5)


def modules(cache: Path | None) -> set[str]:
    return {p.name for p in cache.rglob("*.ptx")} if cache is not None else set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kernel-cache", type=Path, default=None, help="the server's MLX_PTX_CACHE_DIR")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
    with httpx.Client(base_url=args.url, timeout=600) as client:
        wait_warm(client, 600)
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        for name, extra in CASES:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Tell me about the weather in a city you like."}],
                "max_tokens": args.max_tokens,
                **extra,
            }
            times, added = [], []
            for _ in range(2):
                before = modules(args.kernel_cache)
                t0 = time.perf_counter()
                status = client.post("/v1/chat/completions", json=body).status_code
                times.append(time.perf_counter() - t0)
                added.append(sorted(modules(args.kernel_cache) - before))
            results.append(
                {"case": name, "status": status, "first_s": times[0], "second_s": times[1], "built": added[0]}
            )
            print(
                f"{name:20s} {status}  first {times[0] * 1000:7.0f} ms  second {times[1] * 1000:7.0f} ms"
                + (f"  kernels built: {added[0]}" if added[0] else "")
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
