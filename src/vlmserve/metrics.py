"""Prometheus metrics, named after vLLM's with a `vlmserve:` prefix and a model_name label."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
_BATCH = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)


class Metrics:
    """One registry per server, so several servers in one process never collide."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"vlmserve:{name}", doc, m, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(f"vlmserve:{name}", doc, m + list(extra), registry=r)
            return c if extra else c.labels(model_name)

        def hist(name, doc, buckets=_LATENCY):
            return Histogram(f"vlmserve:{name}", doc, m, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests prefilling or decoding")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission")
        self.prefix_cache_usage = gauge("prefix_cache_usage_perc", "Fraction of the prefix cache token budget in use")
        self.mm_prefix_cache_usage = gauge(
            "mm_prefix_cache_usage_perc",
            "Fraction of the multimodal prefix cache's token budget in use (image requests)",
        )
        self.kv_cache_tokens = gauge("kv_cache_usage_tokens", "Tokens held in the running batch's KV cache")
        self.kv_blocks_used = gauge("kv_blocks_used", "KV budget blocks held by admitted requests")
        self.kv_blocks_free = gauge("kv_blocks_free", "KV budget blocks free")
        self.kv_blocks_cached = gauge(
            "kv_blocks_cached", "KV pool blocks cached prefixes hold (shared with rows, or free as rows need them)"
        )
        self.device_memory = Gauge(
            "vlmserve:device_memory_bytes",
            "MLX device memory: active, cache (freed buffers kept), peak (since start), kv_pool (KV block pools), "
            "row_states (convolution or recurrent state of the running rows' decode slots), "
            "prefix_states (that state kept with cached prefixes)",
            m + ["kind"],
            registry=r,
        )
        self.warmup_pending = gauge(
            "warmup_pending",
            "Warm-up left after /ready: quantized matmul kernels building in the background, prompt piece "
            "lengths to run (0: fully warm)",
        )
        self.preemptions = gauge(
            "num_preemptions", "Requests put aside (KV to host memory) when KV blocks ran out, since start"
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated")
        self.success = counter("request_success_total", "Finished requests", ["finished_reason"])
        self.failure = counter("request_failure_total", "Failed requests", ["reason"])
        self.prefix_queries = counter("prefix_cache_queries_total", "Prefix cache lookups (text-only requests)")
        self.prefix_hits = counter("prefix_cache_hits_total", "Prefix cache lookups that reused KV")
        self.mm_prefix_queries = counter(
            "mm_prefix_cache_queries_total", "Prefix lookups of requests with images (keys carry image content)"
        )
        self.mm_prefix_hits = counter(
            "mm_prefix_cache_hits_total", "Prefix lookups of requests with images that reused KV"
        )
        self.feature_queries = counter(
            "mm_feature_cache_queries_total", "Vision-feature cache lookups (image requests)"
        )
        self.feature_hits = counter(
            "mm_feature_cache_hits_total", "Vision-feature lookups that skipped the vision tower"
        )
        self.image_fetch_failures = counter("image_fetch_failures_total", "Images that could not be fetched or decoded")
        self.preprocess_jobs = counter(
            "preprocess_requests_total", "Requests preprocessed, by pool (threads, or --preprocess-processes)", ["pool"]
        )
        self.ttft = hist("time_to_first_token_seconds", "Request arrival to first token")
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between deliveries of one request's tokens (a reader behind gets several at once)",
        )
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.queue_time = hist("request_queue_time_seconds", "Time waiting for admission")
        self.preprocess = hist("preprocess_seconds", "CPU preprocessing time (template, images, tokenize)")
        self.vision = hist("vision_encode_seconds", "Vision encoder + embedding time per image request")
        self.prefill = hist("prefill_seconds", "Time of one prefill chunk")
        self.decode_step = hist("decode_step_seconds", "Time of one batched decode step", _STEP)
        self.batch_size = hist("batch_size", "Rows in a decode step", _BATCH)
        self.loop_lag = hist("event_loop_lag_seconds", "How late the event loop woke a 50 ms timer")

    def fail(self, reason: str) -> None:
        self.failure.labels(self.model_name, reason).inc()

    def succeed(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def preprocessed(self, pool: str) -> None:
        self.preprocess_jobs.labels(self.model_name, pool).inc()


class SchedulerHooks:
    """Called by the scheduler on the worker thread; prometheus_client is thread-safe."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def on_admit(self, req) -> None:
        self.on_queue_time(time.monotonic() - req.arrival)

    def on_queue_time(self, seconds: float) -> None:
        self.m.queue_time.observe(seconds)

    def on_vision(self, seconds: float) -> None:
        self.m.vision.observe(seconds)

    def on_prefill(self, seconds: float) -> None:
        self.m.prefill.observe(seconds)

    def on_decode_step(self, seconds: float, batch: int) -> None:
        self.m.decode_step.observe(seconds)
        self.m.batch_size.observe(batch)

    def on_prefix_lookup(self, hit: bool, images: bool = False) -> None:
        m = self.m
        queries, hits = (m.mm_prefix_queries, m.mm_prefix_hits) if images else (m.prefix_queries, m.prefix_hits)
        queries.inc()
        if hit:
            hits.inc()
