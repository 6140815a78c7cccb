#!/usr/bin/env python3
"""How long running streams stall when a request needs shapes the server has not run yet.

Several streams decode; one second in, a long text prompt arrives, longer than anything the
server warmed up (its prefill chunks and the decode step's KV capacity are new). Each stream's
longest gap between two chunks is recorded, for each long prompt in turn: the first of a
length meets new shapes, a repeat of it meets none, so the two gaps side by side show what the
new shapes cost everyone else.

    python benchmarks/new_shape_probe.py --url http://127.0.0.1:8000 --words 2500,2500,6000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


async def _stream(client: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell story {i} about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    last, worst = None, 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                if last is not None:
                    worst = max(worst, now - last)
                last = now
    return worst


async def _long(client: httpx.AsyncClient, model: str, words: int) -> dict:
    text = " ".join(f"word{k % 97}" for k in range(words))
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 20, "temperature": 0}
    t0 = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body)
    usage = response.json().get("usage") or {}
    return {
        "status": response.status_code,
        "seconds": time.perf_counter() - t0,
        "prompt_tokens": usage.get("prompt_tokens"),
    }


async def probe(url: str, words: list[int], streams: int, max_tokens: int) -> list[dict]:
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for n in words:
            tasks = [asyncio.create_task(_stream(client, model, i, max_tokens)) for i in range(streams)]
            await asyncio.sleep(1.0)
            record = await _long(client, model, n)
            gaps = sorted(await asyncio.gather(*tasks))
            record.update(
                words=n, worst_gap_ms=round(gaps[-1] * 1000), median_worst_gap_ms=round(gaps[len(gaps) // 2] * 1000)
            )
            print(
                f"{record['prompt_tokens']} prompt tokens: {record['status']} in {record['seconds']:.2f} s; "
                f"streams' worst gap {record['worst_gap_ms']} ms (median {record['median_worst_gap_ms']} ms)",
                flush=True,
            )
            results.append(record)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--words", default="2500,2500,6000", help="long prompts' lengths in words, in order")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=300, help="each stream's output length")
    p.add_argument("--out", default=None, help="write the records here (JSON)")
    args = p.parse_args()
    results = asyncio.run(probe(args.url, [int(w) for w in args.words.split(",")], args.streams, args.max_tokens))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
