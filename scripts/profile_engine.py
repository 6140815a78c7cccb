#!/usr/bin/env python3
"""Drive the scheduler directly (no HTTP) and time each phase of its steps.

    python scripts/profile_engine.py MODEL --requests 64 --concurrency 32 --max-tokens 128

The scheduler gets the server's defaults (ServerConfig: prefill budget, buckets, compiled
decode on GPU, the same warm-up of decode shapes); all requests' inputs are prepared up
front, so TTFT here is the engine's alone (no HTTP, no CPU preprocessing).
Also times raw eager decode steps at the same batch size, for the floor.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench import make_image, make_prompt  # noqa: E402
from vlmserve.config import ServerConfig  # noqa: E402
from vlmserve.engine.model import VLM  # noqa: E402
from vlmserve.engine.processor import load_processor  # noqa: E402
from vlmserve.engine.scheduler import EngineRequest, MLLMScheduler  # noqa: E402
from vlmserve.engine.tokenizer import TextCodec  # noqa: E402
from vlmserve.media import MediaPolicy, decode_image, load_image_bytes  # noqa: E402
from vlmserve.preprocess import Preprocessor  # noqa: E402
from vlmserve.protocol import ChatMessage, ImageRef, SamplingParams  # noqa: E402


def probe_shapes(vlm, pre) -> None:
    """Does a prompt length never seen before cost more (kernel JIT / plan building)?"""
    for words in (30, 31, 32, 30, 31, 32, 90, 90):
        prompt = pre.render([ChatMessage("user", [("text", make_prompt(words))])])
        prep = pre.encode(prompt, [])
        t = time.perf_counter()
        st = vlm.embed_prompt(prep)
        vlm.prefill(st, 0, prep.num_prompt_tokens)
        mx.eval([c.state for c in st.cache])
        print(f"  probe prefill L={prep.num_prompt_tokens}: {(time.perf_counter() - t) * 1000:.1f} ms")
    for size in (448, 448, 336, 336):
        img = decode_image(load_image_bytes(make_image(size, size), MediaPolicy()), MediaPolicy())
        prompt = pre.render([ChatMessage("user", [("image", ImageRef("x", "x")), ("text", "hi")])])
        prep = pre.encode(prompt, [img])
        t = time.perf_counter()
        st = vlm.embed_prompt(prep)
        mx.eval(st.embeds)
        t1 = time.perf_counter()
        vlm.prefill(st, 0, prep.num_prompt_tokens)
        mx.eval([c.state for c in st.cache])
        print(f"  probe image {size}: embed {(t1 - t) * 1000:.1f} ms, prefill L={prep.num_prompt_tokens} "
              f"{(time.perf_counter() - t1) * 1000:.1f} ms")


def probe_embed(vlm, prepared) -> None:
    """Where batched embedding of a burst's requests goes, each part synchronized (equal image sizes, as in W1)."""
    from vlmserve.engine.model import _device_inputs

    tower = vlm.model.vision_tower
    for _ in range(2):
        marks = [time.perf_counter()]
        inputs = [_device_inputs(p) for p in prepared]
        mx.eval(inputs)
        marks.append(time.perf_counter())
        pixels = mx.concatenate([i["pixel_values"] for i in inputs]).astype(tower.patch_embed.proj.weight.dtype)
        grid = mx.concatenate([i["image_grid_thw"] for i in inputs])
        mx.eval(pixels, grid)
        marks.append(time.perf_counter())
        features = tower(pixels, grid, output_hidden_states=False)
        mx.eval(features)
        marks.append(time.perf_counter())
        per = mx.split(features, [k * (features.shape[0] // len(prepared)) for k in range(1, len(prepared))])
        states = [vlm.embed_prompt(p, f, i) for p, f, i in zip(prepared, per, inputs)]
        mx.eval([s.embeds for s in states])
        marks.append(time.perf_counter())
        states = vlm.embed_prompts(prepared)
        mx.eval([s.embeds for s in states])
        marks.append(time.perf_counter())
    names = ("to device", "concat+cast", "tower", "embed_prompt x n", "embed_prompts (all)")
    print(f"embed {len(prepared)} requests: " + ", ".join(
        f"{n} {(b - a) * 1000:.1f} ms" for n, a, b in zip(names, marks, marks[1:])), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--prefill-chunk", type=int, default=ServerConfig.prefill_chunk)
    p.add_argument("--probe-shapes", action="store_true", help="time prefill at new vs seen prompt lengths")
    p.add_argument("--probe-embed", type=int, default=0, help="time the parts of embedding N requests at once")
    p.add_argument("--sync-phases", action="store_true",
                   help="synchronize after each phase, so its time includes the device work it queued")
    args = p.parse_args()

    path = Path(args.model)
    t0 = time.perf_counter()
    vlm = VLM(path)
    codec = TextCodec(path)
    pre = Preprocessor(load_processor(path), vlm.info.context_length, ServerConfig(), pixel_dtype=vlm.info.pixel_dtype)
    print(f"load {time.perf_counter() - t0:.2f}s")
    prompt = pre.render([ChatMessage("user", [("image", ImageRef("x", "x")), ("text", make_prompt(40))])])
    prepared = []
    for i in range(args.requests):
        img = decode_image(load_image_bytes(make_image(i, args.image_size), MediaPolicy()), MediaPolicy())
        prepared.append(pre.encode(prompt, [img]))
    print(f"prompt tokens {prepared[0].num_prompt_tokens}")

    if args.probe_shapes:
        probe_shapes(vlm, pre)
    if args.probe_embed:
        probe_embed(vlm, prepared[: args.probe_embed])
        probe_embed(vlm, prepared[: max(1, args.probe_embed // 4)])
    cfg = ServerConfig()
    sched = MLLMScheduler(vlm, codec, max_num_seqs=args.concurrency, prefill_chunk=args.prefill_chunk,
                          prefill_budget=cfg.prefill_token_budget, prefill_bucket=cfg.prefill_bucket,
                          prefix_cache_tokens=0, compile_decode=mx.default_device() == mx.gpu)
    t0 = time.perf_counter()
    warmed = sched.batches.warm(args.concurrency, min(vlm.info.context_length, 2 * args.prefill_chunk))
    print(f"warmed {warmed} decode shapes in {time.perf_counter() - t0:.1f}s")
    timers: dict[str, list[float]] = defaultdict(list)
    phases = ["_admit", "_prefill", "_decode", "_launch", "_resolve"]
    if args.sync_phases:  # nested: _prefill holds _embed_upcoming, _embed, _prefill_group, _prefill_one, _join
        phases += ["_embed_upcoming", "_embed", "_prefill_group", "_prefill_one", "_join"]
    for name in phases:
        real = getattr(sched, name)

        def timed(*a, _real=real, _name=name, **k):
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                if args.sync_phases:
                    mx.synchronize()
                timers[_name].append(time.perf_counter() - t)

        setattr(sched, name, timed)

    done = []
    ttfts = []
    pending = list(prepared)

    def submit():
        prep = pending.pop(0)
        start = time.perf_counter()
        first = []

        def emit(ev):
            if ev.token_ids and not first:
                first.append(1)
                ttfts.append(time.perf_counter() - start)
            if ev.finish_reason is not None:
                done.append(time.perf_counter())
                if pending:
                    submit()

        sched.add(EngineRequest(f"r{len(pending)}", prep, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                                         ignore_eos=True), emit))

    def run(label):
        done.clear()
        ttfts.clear()
        for _ in range(min(args.concurrency, len(pending))):
            submit()
        steps = 0
        t = time.perf_counter()
        while sched.has_work():
            sched.step()
            steps += 1
        wall = time.perf_counter() - t
        ttft = sorted(ttfts)
        print(f"[{label}] {len(done)} requests, {steps} steps, {wall:.2f}s, "
              f"{len(done) * args.max_tokens / wall:.0f} tok/s, decode steps {sched.stats.decode_steps}, "
              f"engine TTFT p50 {ttft[len(ttft) // 2] * 1000:.0f} ms max {ttft[-1] * 1000:.0f} ms")

    pending[:] = prepared[: max(2, args.concurrency // 4)]
    run("warmup")
    for v in timers.values():
        v.clear()
    sched.stats.decode_steps = 0
    pending[:] = list(prepared)
    run("measure")
    for name, vals in timers.items():
        if vals:
            print(f"  {name:9s} n={len(vals):5d} mean={sum(vals) / len(vals) * 1000:7.2f}ms "
                  f"total={sum(vals):6.2f}s")

    # Raw floor: eager batched decode at this batch size on a synthetic cache.
    B = args.concurrency
    caches = []
    for prep in prepared[:B]:
        st = vlm.embed_prompt(prep)
        vlm.prefill(st, 0, prep.num_prompt_tokens)
        mx.eval([c.state for c in st.cache])
        caches.append(st.cache)
    batch = vlm.merge_caches(caches)
    tokens = mx.zeros((B,), dtype=mx.int32)
    pos = mx.full((B,), prepared[0].num_prompt_tokens, dtype=mx.int32)
    for i in range(5):
        mx.eval(mx.argmax(vlm.decode(tokens, batch, pos), axis=-1))
    t = time.perf_counter()
    n = 50
    for i in range(n):
        tokens = mx.argmax(vlm.decode(tokens, batch, pos + i), axis=-1).astype(mx.int32)
        mx.async_eval(tokens)
    mx.eval(tokens)
    step = (time.perf_counter() - t) / n
    print(f"raw eager decode B={B}: {step * 1000:.2f} ms/step, {B / step:.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
