"""Reuse across the turns of an image chat, and of one image across requests.

Two checks against any OpenAI-compatible server:
  - chats: each of `--chats` conversations (one at a time, each about a new 1024x768 image) runs
    `--turns` turns, every turn sending the whole history with the model's earlier answers; it
    reports each turn's TTFT (median over the chats), its ratio to turn 1's and the
    `cached_tokens` the server reported;
  - same image: `--same-image` requests with different prompts about one new image, all at once;
    from vlmserve's /metrics it reports how often the vision tower ran for them (feature-cache
    lookups that missed).

    python benchmarks/multiturn.py --url http://127.0.0.1:8000 --out multiturn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench import discover_model, make_image, make_prompt  # noqa: E402

QUESTIONS = (
    "Describe this image in detail.",
    "What colours dominate it, and where?",
    "Write a short title for it.",
    "Is there any text in the image?",
    "What would you change to improve its composition?",
    "Describe its lighting.",
    "List three objects it might contain.",
    "Summarise it in one sentence.",
)


async def ask(client: httpx.AsyncClient, url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat completion: its TTFT, answer and usage."""
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            usage = payload.get("usage") or usage
            for choice in payload.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(delta)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start, "text": "".join(text), "usage": usage}


# vlmserve's histograms read around each turn (one chat at a time): where a turn's TTFT went.
PHASES = {
    "preprocess": "vlmserve:preprocess_seconds",
    "queue": "vlmserve:request_queue_time_seconds",
    "vision": "vlmserve:vision_encode_seconds",
    "prefill": "vlmserve:prefill_seconds",
    "server_ttft": "vlmserve:time_to_first_token_seconds",  # arrival to first token, as the server saw it
}


def phase_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds spent in each phase, and prefill forwards, between two /metrics reads."""
    out = {}
    for name, metric in PHASES.items():
        out[f"{name}_ms"] = 1e3 * (after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0))
    out["prefill_forwards"] = after.get("vlmserve:prefill_seconds_count", 0.0) - before.get(
        "vlmserve:prefill_seconds_count", 0.0
    )
    return out


async def chat(client, url: str, model: str, index: int, turns: int, max_tokens: int, size: tuple[int, int]) -> list:
    image = {"type": "image_url", "image_url": {"url": make_image(10_000 + index, size)}}
    messages: list = []
    results = []
    for turn in range(turns):
        question = QUESTIONS[turn % len(QUESTIONS)] + " " + make_prompt(20)
        content = [image, {"type": "text", "text": question}] if turn == 0 else question
        messages.append({"role": "user", "content": content})
        before = await counters(client, url)
        answer = await ask(client, url, model, messages, max_tokens)
        phases = phase_deltas(before, await counters(client, url)) if before else {}
        messages.append({"role": "assistant", "content": answer["text"]})
        details = answer["usage"].get("prompt_tokens_details") or {}
        results.append(
            {
                "turn": turn + 1,
                "ttft": answer["ttft"],
                "prompt_tokens": answer["usage"].get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens", 0),
                **phases,
            }
        )
    return results


async def counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """vlmserve's counters by name (labels dropped, summed); empty for a server without /metrics."""
    response = await client.get(f"{url}/metrics")
    if response.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in response.text.splitlines():
        match = re.match(r"^([\w:]+?)(?:_total)?(?:\{[^}]*\})? (\S+)$", line)
        if match:
            out[match[1]] = out.get(match[1], 0.0) + float(match[2])
    return out


async def same_image(client, url: str, model: str, requests: int, max_tokens: int, size: tuple[int, int]) -> dict:
    image = {"type": "image_url", "image_url": {"url": make_image(20_000, size)}}
    before = await counters(client, url)
    answers = await asyncio.gather(
        *(
            ask(client, url, model, [{"role": "user", "content": [image, {"type": "text", "text": q}]}], max_tokens)
            for q in (QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(requests))
        )
    )
    after = await counters(client, url)
    queries = after.get("vlmserve:mm_feature_cache_queries", 0) - before.get("vlmserve:mm_feature_cache_queries", 0)
    hits = after.get("vlmserve:mm_feature_cache_hits", 0) - before.get("vlmserve:mm_feature_cache_hits", 0)
    return {
        "requests": requests,
        "ttft_p50": statistics.median(a["ttft"] for a in answers),
        "feature_cache_queries": queries,
        "vision_tower_runs": queries - hits if after else None,
    }


async def run(args) -> dict:
    size = tuple(int(v) for v in args.image_size.split("x"))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or await discover_model(args.url)
        chats = [await chat(client, args.url, model, i, args.turns, args.max_tokens, size) for i in range(args.chats)]
        turns = []
        for t in range(args.turns):
            ttft = statistics.median(c[t]["ttft"] for c in chats)
            turns.append(
                {
                    "turn": t + 1,
                    "ttft_p50": ttft,
                    "ratio_to_turn_1": ttft / statistics.median(c[0]["ttft"] for c in chats),
                    "prompt_tokens": chats[-1][t]["prompt_tokens"],
                    "cached_tokens": chats[-1][t]["cached_tokens"],
                    # medians over the chats of the server's phases (vlmserve only)
                    **{
                        k: statistics.median(c[t][k] for c in chats)
                        for k in chats[0][t]
                        if k.endswith(("_ms", "_forwards"))
                    },
                }
            )
        shared = await same_image(client, args.url, model, args.same_image, args.max_tokens, size)
    return {"url": args.url, "model": model, "image_size": args.image_size, "turns": turns}, chats, shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--same-image", type=int, default=8, help="concurrent requests about one image")
    parser.add_argument("--image-size", default="1024x768")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result, chats, shared = asyncio.run(run(args))
    result.update(chats=chats, same_image=shared)
    for t in result["turns"]:
        print(
            f"turn {t['turn']}: TTFT p50 {t['ttft_p50'] * 1e3:.0f} ms ({t['ratio_to_turn_1']:.2f}x turn 1), "
            f"prompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']}"
            + "".join(f", {k} {t[k]:.0f}" for k in t if k.endswith(("_ms", "_forwards")))
        )
    s = result["same_image"]
    print(
        f"same image x{s['requests']} at once: TTFT p50 {s['ttft_p50'] * 1e3:.0f} ms, "
        f"vision tower runs {s['vision_tower_runs']} of {s['feature_cache_queries']:.0f} lookups"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
