"""`vlmserve serve [MODEL] ...` and `vlmserve caption ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from vlmserve.config import DEFAULT_MODEL_DIR, ServerConfig
from vlmserve.cuda_graphs import choose_cuda_graphs
from vlmserve.kernel_cache import use_persistent_kernel_cache
from vlmserve.logging import start_logging
from vlmserve.torchless import keep_torch_out


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _image_limit(value: str) -> int:
    """--limit-mm-per-prompt: 'image=N' or '{"image": N}' (vLLM's two spellings); images only."""
    try:
        limits = json.loads(value) if value.strip().startswith("{") else dict(kv.split("=", 1) for kv in _csv(value))
        count = int(limits["image"])
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError("expected image=N or '{\"image\": N}'") from exc
    if count < 0 or set(limits) - {"image"}:
        raise argparse.ArgumentTypeError("only a non-negative image count is taken")
    return count


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument(
        "model",
        nargs="?",
        default=str(DEFAULT_MODEL_DIR),
        help="local model directory or Hugging Face repo id (default: the embedded tiny qwen2_vl)",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="rows decoded together")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=d.prefill_chunk,
        help="longest prompt piece prefilled in one forward while other rows decode",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=d.prefill_token_budget,
        help="prompt tokens per scheduler step over all requests; short prompts that fit share one forward",
    )
    p.add_argument(
        "--prefill-bucket",
        type=int,
        default=d.prefill_bucket,
        help="pad prompt lengths to multiples of this so new lengths reuse compiled kernels (0: exact)",
    )
    p.add_argument(
        "--working-memory",
        dest="working_memory_gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory a scheduler step's temporaries may take above the weights, KV and caches in use before "
        "MLX waits for the GPU to free some (default: 1/80 of the device's memory, 1 to 2 GiB; 0: no bound)",
    )
    p.add_argument(
        "--mlx-cache-limit-gb",
        type=float,
        default=d.mlx_cache_limit_gb,
        help="GiB of freed device buffers MLX keeps for reuse (while a step runs, within --working-memory)",
    )
    p.add_argument(
        "--release-cache-after-idle",
        dest="release_cache_after_idle_s",
        type=float,
        default=d.release_cache_after_idle_s,
        metavar="SECONDS",
        help="hand those buffers back after this long without work",
    )
    p.add_argument(
        "--compile-decode",
        choices=["auto", "on", "off"],
        default=d.compile_decode,
        help="run each decode step as one compiled graph (auto: on GPU)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    p.add_argument("--prefix-cache-tokens", type=int, default=d.prefix_cache_tokens, help="0 disables")
    p.add_argument(
        "--mm-cache",
        action=argparse.BooleanOptionalAction,
        default=d.mm_cache,
        help="reuse vision features and prompt KV for image requests by image content (--no-mm-cache: none)",
    )
    p.add_argument(
        "--mm-feature-cache-gb", type=float, default=d.mm_feature_cache_gb, help="GiB of vision features kept"
    )
    p.add_argument(
        "--kv-cache-memory",
        dest="kv_cache_memory_gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory for KV blocks (default: what --gpu-memory-utilization leaves after the weights)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="share of the device's memory the server may use, weights and KV blocks together",
    )
    p.add_argument(
        "--block-size", dest="kv_block_size", type=int, default=d.kv_block_size, help="positions per KV block"
    )
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument(
        "--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) to use instead"
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "mistral", "llama3_json", "pythonic"],
        default=d.tool_call_parser,
        help="the format of the model's tool calls (auto: from its chat template)",
    )
    p.add_argument("--preprocess-workers", type=int, default=d.preprocess_workers)
    p.add_argument(
        "--preprocess-processes",
        type=int,
        default=d.preprocess_processes,
        help="preprocess in this many spawned processes instead of threads (0: threads)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the MLX worker in a process of its own, off the HTTP process's GIL "
        "(--no-engine-process: one process)",
    )
    p.add_argument(
        "--max-pending-preprocess",
        type=int,
        default=d.max_pending_preprocess,
        help="requests queued for or inside the CPU pool before 429",
    )
    p.add_argument("--image-fetch-timeout", type=float, default=d.image_fetch_timeout)
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    p.add_argument("--max-images-per-request", type=int, default=d.max_images_per_request)
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_image_limit,
        default=None,
        metavar="image=N",
        help="vLLM's spelling of --max-images-per-request: 'image=N' or '{\"image\": N}'",
    )
    p.add_argument(
        "--allowed-media-domains",
        type=_csv,
        default=(),
        help="comma list: image URLs only from these domains and their subdomains (default: any public host)",
    )
    p.add_argument("--max-pixels", type=int, default=None, help="downscale images above this many pixels")
    p.add_argument(
        "--allowed-image-hosts",
        type=_csv,
        default=(),
        help="comma list of hosts/CIDRs allowed despite being non-public",
    )
    p.add_argument("--allow-local-image-files", default=None, metavar="DIR", help="allow file:// URLs under DIR")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLMSERVE_API_KEY)"
    )
    p.add_argument("--metrics-require-key", action="store_true", help="also require the key on /metrics")
    p.add_argument(
        "--cors-origins",
        type=_csv,
        default=(),
        help="comma list of origins browsers may call from ('*': any; default: loopback pages only, no CORS)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_csv,
        default=(),
        help="bound to loopback: Host names accepted besides loopback ones, e.g. a reverse proxy's ('*': any)",
    )
    p.add_argument(
        "--max-waiting", type=int, default=d.max_waiting, help="waiting requests (queued + preprocessing) before 429"
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="seconds running requests may take to finish after SIGTERM/SIGINT",
    )
    p.add_argument(
        "--http-header-timeout",
        type=float,
        default=d.http_header_timeout,
        help="close a connection whose request headers take longer than this (slow clients); 0: no limit",
    )
    p.add_argument(
        "--http-keep-alive-timeout",
        type=float,
        default=d.http_keep_alive_timeout,
        help="close a kept-alive connection idle for this long",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="past this many open connections requests get 503, except /health, /ready, /metrics "
        "(default: the open-file limit less 128)",
    )
    p.add_argument(
        "--engine-restarts",
        type=int,
        default=d.engine_restarts,
        help="engine deaths or failed starts within 10 minutes the server recovers from by starting the "
        "engine process again; one more and it exits non-zero",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=d.stall_timeout,
        help="/health turns 503 when the worker's heartbeat is older than this",
    )
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=d.gil_switch_interval_ms,
        help="CPython GIL switch interval for this process (CPython's default is 5)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=d.cuda_graphs,
        help="let MLX record GPU work into CUDA graphs (CUDA only; off by default: every new prompt "
        "length then costs tens of ms to instantiate graphs; MLX_USE_CUDA_GRAPHS in the environment "
        "is kept when this is not given)",
    )
    p.add_argument(
        "--event-loop",
        default=d.event_loop,
        choices=["asyncio", "uvloop"],
        help="uvicorn's event loop (asyncio's measured faster under load: docs/deployment.md)",
    )
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument(
        "--exit-when-warm",
        action="store_true",
        help="load, warm up and exit once fully warm (exit status 0): fills the kernel cache of a new "
        "machine or image, so later starts read every kernel from it (docs/deployment.md)",
    )
    p.add_argument(
        "--warmup-image-sizes",
        type=lambda v: tuple(int(x) for x in _csv(v)),
        default=d.warmup_image_sizes,
        help="comma list of square image sizes to compile before reporting ready",
    )
    p.add_argument(
        "--listen-while-loading",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bind before the model is loaded (/health 200, /ready 503 until warm)",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "limit_mm_per_prompt", None) is not None:
        values["max_images_per_request"] = args.limit_mm_per_prompt
    if values.get("api_key") is None:
        values["api_key"] = os.environ.get("VLMSERVE_API_KEY") or None
    return ServerConfig(**values)


def _make_server(app, config: ServerConfig):
    """uvicorn.Server whose first SIGTERM/SIGINT drains before uvicorn closes the listener.

    Plain uvicorn closes the listener at once, waits for connections, and runs the lifespan
    shutdown last, so /ready never reports the drain and a probe gets "connection refused";
    it also re-raises the captured signal after shutdown, so the process dies of SIGTERM
    instead of exiting 0. Here: drain (admission stopped, /ready 503, running requests
    finish up to --drain-timeout, the rest get an error event), then let uvicorn shut down.
    A second signal skips the rest of the drain.
    """
    import asyncio
    import signal

    import uvicorn

    from vlmserve.entrypoints.openai.http_protocol import default_max_connections, http_protocol

    state = app.state.server

    class Server(uvicorn.Server):
        loop = None
        drain_task = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):  # signal handler, main thread; not re-raised after shutdown
            if self.loop is None or self.drain_task is not None or not self.started:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            logging.getLogger("vlmserve").info("received %s: draining", signal.Signals(sig).name)
            self.drain_task = True  # claimed; the task itself is created on the loop
            self.loop.call_soon_threadsafe(self._begin_drain)

        def _begin_drain(self):
            async def drain_then_exit():
                try:
                    await state.drain()
                finally:
                    self.should_exit = True

            self.drain_task = asyncio.ensure_future(drain_then_exit())

    def stop_serving():
        server.should_exit = True

    state.stop_serving = stop_serving
    # log_config=None: uvicorn's loggers propagate to the root's queue (log_queue.py).
    server = Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            log_config=None,
            loop=config.event_loop,
            http=http_protocol(config.http_header_timeout, config.max_connections or default_max_connections()),
            timeout_keep_alive=max(1, int(config.http_keep_alive_timeout)),
            timeout_graceful_shutdown=max(1, int(config.graceful_shutdown_extra)),
        )
    )
    return server


def set_process_settings(config: ServerConfig) -> None:
    """Settings of the whole interpreter: only for a process that `vlmserve serve` owns."""
    if config.gil_switch_interval_ms > 0:
        sys.setswitchinterval(config.gil_switch_interval_ms / 1000)
    use_persistent_kernel_cache()  # before any process of the server imports MLX (which starts CUDA)
    choose_cuda_graphs(config.cuda_graphs)  # before any process of the server runs GPU work
    keep_torch_out()  # before transformers loads (torchless.py)


def serve(config: ServerConfig) -> int:
    from vlmserve.entrypoints.openai.app import create_app

    set_process_settings(config)
    logs = start_logging(config.log_level)
    app = create_app(config)
    server = _make_server(app, config)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 3 when the lifespan startup (model load) fails
        if exc.code not in (0, None):
            logs.stop()
            print(f"vlmserve: failed to start serving {config.model} (see the error above)", file=sys.stderr)
            return 1
        raise
    finally:
        logs.stop()  # writes what is queued; stopping twice is harmless
    state = app.state.server
    if not server.started or state.load_error is not None:
        print(f"vlmserve: failed to start serving {config.model} (see the error above)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    sub.add_parser("caption", help="caption images through one or more servers", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "caption":
        from vlmserve.caption import main as caption_main

        return caption_main(rest, hard_exit=True)  # MLX may abort in interpreter teardown after --in-process
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.exit_when_warm and not args.warmup:
        parser.error("--exit-when-warm fills the kernel cache by warming up: it cannot go with --no-warmup")
    code = serve(config_from_args(args))
    _exit_now(code)
    return code  # not reached


def _exit_now(code: int) -> None:
    """Exit without running C++ static destructors.

    With MLX's per-thread streams created on the worker, normal interpreter teardown
    intermittently aborts ("terminate called without an active exception", exit -6) after a
    clean shutdown. Everything that matters is done by now: flush and leave with our status.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
