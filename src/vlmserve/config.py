"""One place for every operator-tunable limit and size."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# The embedded tiny checkpoint served when no MODEL is given (a checkout's fixtures/).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "qwen2_vl"


@dataclass
class ServerConfig:
    model: str = str(DEFAULT_MODEL_DIR)
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000

    # Scheduler
    max_num_seqs: int = 32
    prefill_chunk: int = 512
    prefill_token_budget: int | None = 8192  # prompt tokens per step over all requests (None: one chunk)
    prefill_bucket: int = 64  # pad prompt lengths to multiples of this; 0 keeps exact shapes
    max_model_len: int | None = None  # None: from the model config
    prefix_cache_tokens: int = 131072
    # Reuse for image requests, keyed by image content: vision features and prompt KV (off: the
    # strict rule, no reuse at all for requests with pixels).
    mm_cache: bool = True
    mm_feature_cache_gb: float = 1.0  # vision features kept for reuse
    # KV memory: this many GB of blocks, or (None) what --gpu-memory-utilization of the device
    # leaves after the weights and a working reserve (engine/memory.py).
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_block_size: int = 32  # positions per KV block
    # Run each decode step as one mx.compile'd graph ("auto": on GPU). CUDA decode is bound by
    # per-kernel launch cost, which fusion and graph replay cut; on CPU the fused-kernel JIT costs more.
    compile_decode: str = "auto"
    working_memory_gb: float | None = None  # a step's temporaries (None: 1/80 of the device, 1-2 GiB)
    mlx_cache_limit_gb: float = 8.0  # MLX keeps freed buffers for reuse; bound that pool
    release_cache_after_idle_s: float = 60.0  # then hand that pool back (the next request re-allocates)
    default_max_tokens: int = 512
    chat_template: str | None = None  # a Jinja file, or the template itself, instead of the model's
    tool_call_parser: str = "auto"  # hermes | mistral | llama3_json | pythonic | auto (from the template)

    # CPU preprocessing
    preprocess_workers: int = max(2, min(8, os.cpu_count() or 2))
    max_pending_preprocess: int = 64
    # >0: preprocessing runs in this many spawned processes instead of the thread pool, so its
    # GIL-held work leaves the serving process (preprocess_processes.py).
    preprocess_processes: int = 0

    # Images
    image_fetch_timeout: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_images_per_request: int = 8
    max_pixels: int | None = None  # resize cap handed to the image processor
    allowed_image_hosts: tuple[str, ...] = ()
    allowed_media_domains: tuple[str, ...] = ()  # when set, image URLs only from these domains (and subdomains)
    allow_local_image_files: str | None = None
    image_cache_entries: int = 256

    # Operations
    api_key: str | None = None
    metrics_require_key: bool = False
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback when bound to loopback
    max_waiting: int = 256
    max_body_bytes: int = 64 * 1024 * 1024
    drain_timeout: float = 30.0
    stall_timeout: float = 60.0
    http_header_timeout: float = 10.0  # a request's headers must arrive within this; 0: no limit
    http_keep_alive_timeout: float = 5.0  # an idle kept-alive connection closes after this
    max_connections: int = 0  # past this, 503 except the probes; 0: from the open-file limit
    engine_restarts: int = 3  # a dead engine is started again this many times in a row, then the server exits
    log_level: str = "info"
    # CPython's GIL switch interval for the `vlmserve serve` process. After each launch the MLX
    # thread waits for the GIL; with CPython's 5 ms default a busy preprocessing or event-loop
    # thread can hold every decode step up by that much (docs/deployment.md).
    gil_switch_interval_ms: float = 0.5
    # MLX's CUDA graphs (cuda_graphs.py): off, since instantiating a graph for every new prompt
    # length costs tens of ms on the request path.
    cuda_graphs: bool = False
    # uvicorn's event loop. asyncio's, not uvloop: uvloop writes to sockets while holding the
    # GIL, and at 32-64 streams that held each decode step's Python back (on an H100:
    # +4-8% tok/s at 32 streams, +16% at 64).
    event_loop: str = "asyncio"
    # Bind before the model is loaded: /health 200 and /ready 503 ("loading") until warm.
    # The CLI turns this on; in-process servers (tests) keep the blocking lifespan.
    listen_while_loading: bool = False
    graceful_shutdown_extra: float = 3.0  # uvicorn's wait for connections after the drain

    # Run the MLX worker (model, scheduler, detokenizing) in a spawned process of its own; this
    # process keeps HTTP, admission and preprocessing. The event loop then never waits for the GIL
    # behind the MLX thread's Python (vLLM's API-server / engine-core split; engine/process_client.py).
    # `vlmserve serve` turns it on unless given --no-engine-process; a config built in code (tests,
    # embedding the app) keeps one process.
    engine_process: bool = False

    # Testing aid: record the thread of every MLX entry point and fail off the worker.
    thread_guard: bool = field(default_factory=lambda: os.environ.get("VLMSERVE_THREAD_GUARD") == "1")
    warmup: bool = True
    exit_when_warm: bool = False  # prepare a machine's kernel cache: exit once fully warm
    warmup_image_sizes: tuple[int, ...] = (64, 448)  # square images compiled before /ready

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.name if path.exists() else self.model
