"""`vlmserve serve [MODEL] ...` and `vlmserve caption ...`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from .config import DEFAULT_MODEL_DIR, ServerConfig


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL_DIR),
                   help="local model directory or Hugging Face repo id (default: the embedded tiny qwen2_vl)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="rows decoded together")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="prompt tokens per scheduler step")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    p.add_argument("--prefix-cache-tokens", type=int, default=d.prefix_cache_tokens, help="0 disables")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--preprocess-workers", type=int, default=d.preprocess_workers)
    p.add_argument("--image-fetch-timeout", type=float, default=d.image_fetch_timeout)
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    p.add_argument("--max-images-per-request", type=int, default=d.max_images_per_request)
    p.add_argument("--max-pixels", type=int, default=None, help="downscale images above this many pixels")
    p.add_argument("--allowed-image-hosts", type=_csv, default=(), help="comma list of hosts/CIDRs allowed despite being non-public")
    p.add_argument("--allow-local-image-files", default=None, metavar="DIR", help="allow file:// URLs under DIR")
    p.add_argument("--api-key", default=os.environ.get("VLMSERVE_API_KEY"), help="or VLMSERVE_API_KEY")
    p.add_argument("--metrics-require-key", action="store_true")
    p.add_argument("--cors-origins", type=_csv, default=())
    p.add_argument("--max-waiting", type=int, default=d.max_waiting)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout)
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-warmup", dest="warmup", action="store_false")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    return ServerConfig(**values)


def serve(config: ServerConfig) -> int:
    import uvicorn

    from .api.app import create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           timeout_graceful_shutdown=config.drain_timeout + 2))
    server.run()
    if not server.started:
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
        from .caption import main as caption_main

        return caption_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return serve(config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
