#!/usr/bin/env python3
"""Closed-loop load generator for OpenAI-compatible VLM servers (vlmserve, mlx_vlm.server, ...).

Workload W1 by default: one distinct 448x448 image per request (data URI) + ~330 prompt
tokens of text, 128 output tokens, temperature 0, streamed with include_usage, 2*c requests
per concurrency level. `--workload mixed`: 8 image sizes and aspect ratios from 224x224 to
1024x768, ~60-1,100 prompt tokens, 32-256 output tokens, 15% text only, drawn per request.
`--passes 2` sends each level's requests twice and reports each pass (the first pass meets
every shape for the first time). Prints and records output tok/s, req/s, TTFT p50/p99, ITL p50,
E2E p50/p99 and /health p99 (sampled every 100 ms during each level, from a process of its
own, so that the load generator's busy event loop does not delay the probe).

    python benchmarks/bench.py --url http://127.0.0.1:8000 --concurrency 1,8 --out bench.json
    python benchmarks/bench.py --url http://A --label vlmserve --peer-url http://B --peer-label mlx-vlm \\
        --concurrency 1,8,32,64 --out w1.json --plot w1.png
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from PIL import Image

FILLER = (
    "Look at the picture carefully and describe the objects, their colours, the layout of the scene, "
    "any text you can read, the lighting, and what might have happened just before it was taken. "
)


# The mixed workload: what captioning and chat clients send together.
MIXED_SIZES = ((224, 224), (336, 336), (448, 448), (512, 384), (640, 480), (384, 640), (768, 768), (1024, 768))
MIXED_WORDS = (40, 800)  # text words: ~60 to ~1,100 prompt tokens with an image
MIXED_MAX_TOKENS = (32, 256)
MIXED_TEXT_ONLY = 0.15


def make_image(index: int, size: int | tuple[int, int], variant: int = 0) -> str:
    """A distinct deterministic PNG per request, as a data URI; `size` is a side or (width, height).
    Another `variant` gives other pixels at the same size."""
    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng([index, variant] if variant else index)
    base = rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_prompt(words: int, variant: int = 0) -> str:
    """`words` words of filler text; another `variant` starts elsewhere in it (other tokens)."""
    filler = FILLER.split()
    start = 7 * variant % len(filler)
    text = (filler[start:] + filler * (words // len(filler) + 1))[:words]
    return " ".join(text)


def request_spec(index: int, settings: dict) -> dict:
    """Request `index` of the workload: its image (a data URI, or None), text and max_tokens.

    W1: every request alike but for its image. Mixed: a size, prompt length, output length and
    whether it has an image, drawn per request from a generator seeded by its index (so a second
    pass sends the very same requests). `settings["variant"]` (if set and not 0) keeps every size,
    length and max_tokens but changes the pixels and words, so no cache can serve the request."""
    variant = settings.get("variant", 0)
    if settings["workload"] == "w1":
        return {
            "image": make_image(index, settings["image_size"], variant),
            "prompt": make_prompt(settings["prompt_words"], variant),
            "max_tokens": settings["max_tokens"],
        }
    rng = np.random.default_rng(10_000 + index)
    text_only = rng.random() < MIXED_TEXT_ONLY
    size = MIXED_SIZES[int(rng.integers(len(MIXED_SIZES)))]
    return {
        "image": None if text_only else make_image(index, size, variant),
        "prompt": make_prompt(int(rng.integers(MIXED_WORDS[0], MIXED_WORDS[1] + 1)), variant),
        "max_tokens": int(rng.integers(MIXED_MAX_TOKENS[0], MIXED_MAX_TOKENS[1] + 1)),
    }


@dataclass
class Result:
    ok: bool
    start: float = 0.0  # perf_counter() when the request was sent (the same clock as the server's on one host)
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, spec: dict, image_first: bool) -> Result:
    parts = [{"type": "text", "text": spec["prompt"]}]
    if spec["image"] is not None:
        image = {"type": "image_url", "image_url": {"url": spec["image"]}}
        parts = [image, *parts] if image_first else [*parts, image]
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": spec["max_tokens"],
        "ignore_eos": True,
        "messages": [{"role": "user", "content": parts}],
    }
    start = time.perf_counter()
    last = None
    res = Result(ok=False, start=start)
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    res.error = str(payload["error"])[:200]
                    return res
                usage = payload.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                for choice in payload.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        chunks += 1
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = last is not None
    return res


async def sample_health(url: str, stop, ready, period: float = 0.1) -> list[float]:
    samples = []
    async with httpx.AsyncClient(timeout=10) as client:
        await client.get(f"{url}/health")  # connect before the level starts
        ready.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await client.get(f"{url}/health")
                samples.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                samples.append(float("inf"))
            await asyncio.sleep(max(0.0, period - (time.perf_counter() - t0)))
    return samples


def _health_process(url: str, stop, ready, out) -> None:
    out.send(asyncio.run(sample_health(url, stop, ready)))


class HealthProbe:
    """/health latency sampled from a separate process for the duration of a level."""

    def __init__(self, url: str):
        ctx = multiprocessing.get_context("spawn")
        self.stop, self.ready = ctx.Event(), ctx.Event()
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_health_process, args=(url, self.stop, self.ready, send), daemon=True)

    async def start(self) -> HealthProbe:
        self.proc.start()
        if not await asyncio.to_thread(self.ready.wait, 60):
            raise RuntimeError("the /health probe process did not start")
        return self

    async def finish(self) -> list[float]:
        self.stop.set()
        samples = await asyncio.to_thread(self.recv.recv)
        self.proc.join(timeout=10)
        return samples


def gpu_memory_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return float(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


async def gpu_peak(stop: asyncio.Event) -> float | None:
    peak = None
    while not stop.is_set():
        used = await asyncio.to_thread(gpu_memory_mib)
        if used is not None:
            peak = max(peak or 0.0, used)
        await asyncio.sleep(0.5)
    return peak


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, q))


_PROFILE = (
    "decode_step_seconds",
    "prefill_seconds",
    "vision_encode_seconds",
    "batch_size",
    "request_queue_time_seconds",
    "preprocess_seconds",
    "time_to_first_token_seconds",
    "event_loop_lag_seconds",
)
_LAG_LIMIT = "0.02"  # also count event-loop wake-ups later than this (the /health target)


async def scrape_profile(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vlmserve's histograms; empty for servers without /metrics."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"{url}/metrics")
        if r.status_code != 200:
            return {}
        out = {}
        for fam in text_string_to_metric_families(r.text):
            name = fam.name.split(":")[-1]
            if name in _PROFILE:
                total = sum(x.value for x in fam.samples if x.name.endswith("_sum"))
                count = sum(x.value for x in fam.samples if x.name.endswith("_count"))
                out[name] = (total, count)
                if name == "event_loop_lag_seconds":
                    within = sum(x.value for x in fam.samples if x.labels.get("le") == _LAG_LIMIT)
                    out["event_loop_lag_over_20ms"] = (count - within, count)
        return out
    except Exception:  # noqa: BLE001 - profiling is best effort
        return {}


def profile_delta(before: dict, after: dict) -> dict:
    """Mean of each histogram over one level (ms for times), and how many observations."""
    out = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        n = count - c0
        if name.endswith("_over_20ms"):  # a count, not a mean
            out[name] = int(total - t0)
        elif n > 0:
            scale = 1 if name == "batch_size" else 1000
            out[name.replace("_seconds", "_ms_mean")] = round((total - t0) / n * scale, 3)
            out[name.replace("_seconds", "") + "_n"] = int(n)
    return out


async def closed_loop(
    url: str, model: str, specs: list[dict], workers: int, args: dict, ready, go
) -> tuple[list[Result], float, float]:
    """`workers` clients, each sending its next request as soon as its last one ends, until none are
    left; they start when `go` is set. Returns (results, when the last ended, CPU seconds used)."""
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=workers + 4)
    async with httpx.AsyncClient(timeout=args["timeout"], limits=limits) as client:

        async def worker():
            while not queue.empty():
                spec = queue.get_nowait()
                results.append(await one_request(client, url, model, spec, args["image_first"]))

        try:  # this process's first request pays httpx's lazy imports and a connection: not on the clock
            await client.get(f"{url}/health")
        except httpx.HTTPError:
            pass
        ready.set()
        await asyncio.to_thread(go.wait)
        cpu0 = time.process_time()
        await asyncio.gather(*(worker() for _ in range(workers)))
        return results, time.perf_counter(), time.process_time() - cpu0


def _client_process(url, model, indices, workers, args, ready, go, out) -> None:
    """One load-generator process: its share of the level's workers and requests."""
    specs = [request_spec(i, args) for i in indices]  # before the level's clock starts
    results, end, cpu = asyncio.run(closed_loop(url, model, specs, workers, args, ready, go))
    out.send(([asdict(r) for r in results], end, cpu))


async def run_clients(
    url: str, model: str, concurrency: int, indices: list[int], args, processes: int, variant: int = 0
) -> tuple[list[Result], float, float, float]:
    """Run the level from `processes` load-generator processes. Process p holds workers w = p, p + N,
    ... of the c, and the requests those workers would have taken first (n mod c among them), in
    a queue its workers share.

    One Python process spends ~2-3 ms of its event loop on each request it sends (httpx, the
    150 KB body) and on each stream's end, so at c=32 it spread a closed loop's wave of new
    requests over ~100 ms on the H100 host: its own delay, counted in the server's TTFT and
    throughput. Several processes send a wave in parallel. Returns (results, t0, end, cpu s), t0
    being when the first request was sent. `processes` is at most `concurrency`."""
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(processes)]
    go = ctx.Event()
    procs, pipes = [], []
    names = ("workload", "image_size", "prompt_words", "max_tokens", "image_first", "timeout")
    settings = {k: getattr(args, k) for k in names} | {"variant": variant}
    for p in range(processes):
        workers = [w for w in range(concurrency) if w % processes == p]
        mine = [i for n, i in enumerate(indices) if n % concurrency in workers]
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_client_process,
            daemon=True,
            args=(url, model, mine, len(workers), settings, ready[p], go, send),
        )
        proc.start()
        procs.append(proc)
        pipes.append(recv)
    for event in ready:
        if not await asyncio.to_thread(event.wait, 120):
            raise RuntimeError("a load-generator process did not start")
    go.set()
    results, end, cpu = [], 0.0, 0.0
    for recv, proc in zip(pipes, procs):
        rows, finished, used = await asyncio.to_thread(recv.recv)
        results += [Result(**r) for r in rows]
        end, cpu = max(end, finished), cpu + used
        proc.join(timeout=10)
    t0 = min((r.start for r in results), default=end)
    return results, t0, end, cpu


async def run_level(
    url: str, model: str, concurrency: int, n_requests: int, args, offset: int, variant: int = 0
) -> dict:
    stop = asyncio.Event()
    before = await scrape_profile(url)
    health = await HealthProbe(url).start()
    gpu = asyncio.create_task(gpu_peak(stop))
    processes = max(1, min(args.client_processes, concurrency))  # no process without a worker
    results, t0, end, cpu = await run_clients(
        url, model, concurrency, list(range(offset, offset + n_requests)), args, processes, variant
    )
    wall = end - t0
    client_cpu = cpu / wall if wall else 0.0
    stop.set()
    health_s = await health.finish()
    peak = await gpu
    profile = profile_delta(before, await scrape_profile(url))
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "output_tok_s": out_tokens / wall if wall else 0.0,
        "req_s": len(ok) / wall if wall else 0.0,
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in ok) if ok else None,
        "output_tokens_mean": statistics.mean(r.output_tokens for r in ok) if ok else None,
        "ttft_p50_s": pct([r.ttft for r in ok], 50),
        "ttft_p99_s": pct([r.ttft for r in ok], 99),
        "ttft_first_s": min(ok, key=lambda r: r.start).ttft if ok else None,
        "itl_p50_s": pct(itls, 50),
        "e2e_p50_s": pct([r.e2e for r in ok], 50),
        "e2e_p99_s": pct([r.e2e for r in ok], 99),
        "health_p99_s": pct(health_s, 99),
        "health_samples": len(health_s),
        "gpu_mem_peak_mib": peak,
        "client_processes": processes,
        # the load generators' CPU time / wall time (summed over processes; 1.0 = one core busy)
        "client_cpu": client_cpu,
        "level_start_monotonic_s": t0,
        # each request, in the order sent: [sent (s after the level's start), TTFT, E2E] (0 for a failed one)
        "timeline": [
            [round(r.start - t0, 4), round(r.ttft, 4), round(r.e2e, 4)] for r in sorted(results, key=lambda r: r.start)
        ],
        "server_profile": profile,
    }


async def discover_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def bench_server(url: str, label: str, model: str | None, args) -> dict:
    model = model or await discover_model(url)
    levels = []
    for number in range(1, args.passes + 1):  # the same requests, or the same shapes with new content
        offset = 0
        variant = number if args.new_content_from and number >= args.new_content_from else 0
        for c in args.concurrency:
            n = args.requests_per_level or 2 * c
            level = await run_level(url, model, c, n, args, offset, variant)
            level["pass"] = number
            level["new_content"] = bool(variant)
            offset += n
            levels.append(level)
            _report(label, number, args.passes, level)
    return {"label": label, "url": url, "model": model, "workload": args.workload, "levels": levels}


def _report(label: str, number: int, passes: int, level: dict) -> None:
    c, n = level["concurrency"], level["requests"]
    tag = (f" pass {number}" if passes > 1 else "") + (", new content" if level.get("new_content") else "")
    print(
        f"[{label}{tag}] c={c:<3} ok={level['ok']}/{n} out={level['output_tok_s']:.1f} tok/s "
        f"req/s={level['req_s']:.2f} TTFT p50={fmt(level['ttft_p50_s'])} p99={fmt(level['ttft_p99_s'])} "
        f"ITL p50={fmt(level['itl_p50_s'])} E2E p50={fmt(level['e2e_p50_s'])} p99={fmt(level['e2e_p99_s'])} "
        f"health p99={fmt(level['health_p99_s'])} client cpu={level['client_cpu']:.0%}"
        f" ({level['client_processes']} proc)"
        + (f" errors={level['errors']}" if level["errors"] else "")
        + (f"\n    profile {level['server_profile']}" if level["server_profile"] else ""),
        flush=True,
    )


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        # The first pass's: what a server makes of requests it has not seen (a later pass of the
        # same requests may be served by its caches).
        run = {**run, "levels": [lv for lv in run["levels"] if lv.get("pass", 1) == 1]}
        cs = [lv["concurrency"] for lv in run["levels"]]
        ax1.plot(cs, [lv["output_tok_s"] for lv in run["levels"]], marker="o", label=run["label"])
        ax2.plot(cs, [lv["ttft_p50_s"] or 0 for lv in run["levels"]], marker="o", label=f"{run['label']} p50")
        ax2.plot(
            cs, [lv["ttft_p99_s"] or 0 for lv in run["levels"]], marker="x", linestyle="--", label=f"{run['label']} p99"
        )
    ax1.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Throughput")
    ax2.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT (s)", title="Time to first token")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--label", default="vlmserve")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--peer-url", default=None, help="a second server to measure in the same run")
    p.add_argument("--peer-label", default="peer")
    p.add_argument("--peer-model", default=None)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency")
    p.add_argument(
        "--workload",
        choices=("w1", "mixed"),
        default="w1",
        help="w1: one image size and prompt; mixed: 8 image sizes and aspect ratios, ~60-1,100 prompt tokens, "
        "32-256 output tokens, 15%% text only (the --image-size, --prompt-words and --max-tokens of W1 do not apply)",
    )
    p.add_argument(
        "--passes", type=int, default=1, help="send each level's requests this many times, reported per pass"
    )
    p.add_argument(
        "--new-content-from",
        type=int,
        default=0,
        help="passes from this number on send the same sizes, lengths and max_tokens with other pixels "
        "and words (nothing cached serves them: a pass that meets no new shape and no cache hit)",
    )
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--prompt-words", type=int, default=40, help="text words (W1: ~330 prompt tokens with the image)")
    p.add_argument("--image-first", action="store_true", default=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="load-generator processes per level, sharing its workers (W1 on the GPU: 4; see run_clients)",
    )
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run to the runs already in --out (measure servers one at a time, plot together)",
    )
    args = p.parse_args(argv)

    async def run_all():
        runs = [await bench_server(args.url, args.label, args.model, args)]
        if args.peer_url:
            runs.append(await bench_server(args.peer_url, args.peer_label, args.peer_model, args))
        return runs

    runs = asyncio.run(run_all())
    measured = runs
    if args.append and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            runs = json.load(f)["runs"] + runs
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": {
            k: getattr(args, k)
            for k in (
                "workload",
                "image_size",
                "prompt_words",
                "max_tokens",
                "concurrency",
                "requests_per_level",
                "passes",
                "new_content_from",
            )
        },
        "runs": runs,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    if args.plot:
        plot(runs, args.plot)
    return 0 if all(lv["ok"] == lv["requests"] for run in measured for lv in run["levels"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
