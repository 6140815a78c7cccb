"""Command line: `python scripts/caption.py INPUT... --out captions.jsonl` / `vlmserve caption ...`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from vlmserve.caption.client import normalize_server
from vlmserve.caption.inputs import InputError, dedupe, discover, skipped_note
from vlmserve.caption.output import RecordWriter, format_for, load_existing, rewrite
from vlmserve.caption.progress import Progress, Stats, summary
from vlmserve.caption.runner import Options, Runner

DEFAULT_PROMPT = "Describe this image in one or two sentences."
DEFAULT_SERVER = "http://127.0.0.1:8000"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
exit status: 0 every image captioned; 1 some images failed (rows with an "error"); 2 bad usage,
unreadable input or a fatal server answer (401/403/404); 130 interrupted (rerun with --resume).

resume: successful rows are kept and skipped; failed rows are dropped from the file and retried;
a trailing partial line left by a hard kill is dropped. A finished run holds one row per image.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a directory (recursive), a glob, an image, an http(s) URL, a text file of paths/URLs, "
        "or a JSONL/CSV/TSV manifest with a path (or url/image/file) column and optional prompt",
    )
    p.add_argument("-o", "--out", required=True, help="output file (one record per image)")
    p.add_argument(
        "--format",
        choices=("jsonl", "csv", "parquet"),
        default=None,
        help="output format (default: from the file name: .csv, .parquet (--ray), else jsonl)",
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="URL",
        help="OpenAI-compatible server; repeat (or comma-separate) for several replicas, used "
        f"together with --concurrency each (default: $VLMSERVE_URL or {DEFAULT_SERVER})",
    )
    g.add_argument(
        "--in-process",
        metavar="MODEL",
        default=None,
        help="no server: load MODEL (local dir or Hugging Face id) into a vlmserve engine in this process",
    )
    g.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="caption on a Ray cluster (ADDRESS, e.g. auto or host:6379; none: a local one), each actor "
        "running --in-process MODEL; output may then also be .parquet (needs the [ray] extra)",
    )
    g.add_argument("--num-replicas", type=int, default=1, help="--ray: actors, each with its own engine (default 1)")
    g.add_argument("--actor-cpus", type=float, default=1.0, help="--ray: CPUs per actor (default 1)")
    g.add_argument("--actor-gpus", type=float, default=0.0, help="--ray: GPUs per actor (default 0)")
    g.add_argument("--batch-size", type=int, default=32, help="--ray: images handed to an actor at a time (default 32)")
    g.add_argument("--model", default=None, help="model name to request (default: ask each server's /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $VLMSERVE_API_KEY, then $OPENAI_API_KEY)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight per server (default 16; --in-process: the engine's batch size, 32)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    g.add_argument(
        "--retries",
        type=int,
        default=5,
        help="retries per image on 429/5xx/connection errors/timeouts; never on other 4xx (default 5)",
    )
    g.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="first retry delay in seconds, doubled per retry, jittered, Retry-After honoured (default 1)",
    )
    g.add_argument("--backoff-max", type=float, default=60.0, help="longest retry delay (default 60)")
    g.add_argument(
        "--give-up-after",
        type=float,
        default=300.0,
        help="stop (exit 2; --resume continues) once every server has failed for this many seconds (default 300)",
    )
    r = p.add_argument_group("request")
    pr = r.add_mutually_exclusive_group()
    pr.add_argument(
        "--prompt",
        default=None,
        help=f"instruction sent with every image (default: {DEFAULT_PROMPT!r}); a manifest's per-row prompt wins",
    )
    pr.add_argument("--prompt-file", default=None, metavar="F", help="read the prompt from a file")
    r.add_argument("--system", default=None, help="optional system message")
    r.add_argument("--max-tokens", type=int, default=256, help="caption length cap (default 256)")
    r.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    r.add_argument("--detail", choices=("auto", "low", "high"), default=None, help="image_url detail")
    r.add_argument(
        "--extra-body", default=None, metavar="JSON", help='extra request fields, e.g. \'{"top_p": 0.9, "seed": 0}\''
    )
    i = p.add_argument_group("input and output")
    i.add_argument("--path-column", default=None, help="manifest column holding the path/URL (default: auto)")
    i.add_argument("--prompt-column", default="prompt", help="manifest column holding a per-row prompt")
    i.add_argument("--limit", type=int, default=None, help="only the first N images of the input")
    i.add_argument("--resume", action="store_true", help="continue an interrupted run: skip images already captioned")
    i.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    i.add_argument("--fsync-every", type=float, default=2.0, help="seconds between fsyncs of the output (default 2)")
    i.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")


def build_parser(prog: str = "vlmserve caption") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Caption many images through OpenAI-compatible vision-language servers, resumably.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def _servers(args: argparse.Namespace) -> list[str]:
    raw = args.server or [os.environ.get("VLMSERVE_URL") or DEFAULT_SERVER]
    urls = [normalize_server(u) for s in raw for u in s.split(",") if u.strip()]
    return list(dict.fromkeys(urls))  # the same replica twice would only double its concurrency


def _eprint(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _options(args, prompt: str, extra: dict, servers: list[str], model, concurrency: int, api_key) -> Options:
    """The request settings of a run, from the command line."""
    return Options(
        servers=servers,
        prompt=prompt,
        model=model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        concurrency=concurrency,
        retries=args.retries,
        backoff_base=args.backoff,
        backoff_max=args.backoff_max,
        timeout=args.timeout,
        give_up_after=args.give_up_after,
        api_key=api_key,
        detail=args.detail,
        system=args.system,
        extra=extra,
    )


def _run_on_ray(args: argparse.Namespace, prompt: str, extra: dict) -> int:
    if not args.in_process or args.server:
        _eprint("caption: --ray needs --in-process MODEL (what each actor loads) and no --server")
        return EXIT_USAGE
    try:
        from vlmserve.caption.ray_pipeline import RayOptions, caption_on_ray
    except ImportError as exc:
        _eprint(f"caption: --ray needs the ray extra (pip install 'vlmserve[ray]'): {exc}")
        return EXIT_USAGE
    request = _options(args, prompt, extra, [], args.model, args.concurrency or 32, None)
    opts = RayOptions(
        model=args.in_process,
        address=None if args.ray == "local" else args.ray,
        num_replicas=args.num_replicas,
        actor_cpus=args.actor_cpus,
        actor_gpus=args.actor_gpus,
        batch_size=args.batch_size,
        request=request,
        path_column=args.path_column,
        prompt_column=args.prompt_column,
        resume=args.resume,
        progress=args.progress,
        quiet=args.quiet,
    )
    out = Path(args.out)
    if args.overwrite and not args.resume and out.exists():
        out.unlink()
    try:
        stats = caption_on_ray(args.inputs, args.out, opts, args.format)
    except (FileExistsError, InputError, OSError, ValueError) as exc:
        _eprint(f"caption: {exc}")
        return EXIT_USAGE
    if not args.quiet:
        _eprint(summary(stats, args.out))
    return EXIT_FAILED if stats.failed else EXIT_OK


def _bad_numbers(args: argparse.Namespace) -> str | None:
    """What is wrong with the numeric options, if anything (every mode checks them first)."""
    for name in ("concurrency", "max_tokens", "limit"):
        v = getattr(args, name)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.retries < 0:
        return "--retries must be >= 0"
    if not args.timeout > 0 or not args.give_up_after > 0:
        return "--timeout and --give-up-after must be > 0"
    if args.backoff < 0 or args.backoff_max < 0:
        return "--backoff and --backoff-max must be >= 0"
    return None


def run(args: argparse.Namespace) -> int:
    """Everything after parsing; returns the exit status."""
    problem = _bad_numbers(args)
    if problem:
        _eprint(f"caption: {problem}")
        return EXIT_USAGE
    if args.ray is not None:
        prompt = Path(args.prompt_file).read_text(encoding="utf-8").strip() if args.prompt_file else args.prompt
        extra = json.loads(args.extra_body) if args.extra_body else {}
        return _run_on_ray(args, prompt or DEFAULT_PROMPT, extra)
    if args.format == "parquet" or args.out.lower().endswith(".parquet"):
        _eprint("caption: Parquet output is written by --ray runs; use .jsonl or .csv here")
        return EXIT_USAGE
    if args.in_process and args.server:
        _eprint("caption: --in-process and --server are exclusive")
        return EXIT_USAGE
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        _eprint(f"caption: --extra-body must be a JSON object ({exc})")
        return EXIT_USAGE
    prompt = args.prompt
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            _eprint(f"caption: cannot read --prompt-file: {exc}")
            return EXIT_USAGE
    prompt = prompt or DEFAULT_PROMPT

    skipped: list[str] = []
    try:
        items, duplicates = dedupe(discover(args.inputs, args.path_column, args.prompt_column, skipped))
    except (InputError, OSError, UnicodeDecodeError) as exc:
        _eprint(f"caption: {exc}")
        return EXIT_USAGE
    if skipped:
        _eprint(skipped_note(skipped))
        if not items:
            return EXIT_USAGE
    if args.limit:
        items = items[: args.limit]

    out = Path(args.out)
    fmt = format_for(args.out, args.format)
    stats = Stats(duplicates=duplicates)
    if out.exists() and out.stat().st_size > 0 and not (args.resume or args.overwrite):
        _eprint(f"caption: {out} exists; pass --resume to continue it or --overwrite to start over")
        return EXIT_USAGE
    if args.overwrite and not args.resume and out.exists():
        out.unlink()
    done_keys: set = set()
    if args.resume:
        try:
            existing = load_existing(out, fmt)
        except (OSError, ValueError) as exc:
            _eprint(f"caption: cannot resume from {out}: {exc}")
            return EXIT_USAGE
        if existing.needs_rewrite:
            rewrite(out, fmt, existing.rows)
            if not args.quiet:
                notes = [
                    f"{n} {what}"
                    for n, what in (
                        (existing.failed, "failed rows (retrying)"),
                        (existing.duplicates, "duplicate rows"),
                        (existing.corrupt, "corrupt lines"),
                        (int(existing.partial_tail), "partial last line"),
                    )
                    if n
                ]
                _eprint(f"caption: resume dropped {', '.join(notes)} from {out}")
        done_keys = existing.done_keys
    todo = [it for it in items if it.key not in done_keys]
    stats.skipped = len(items) - len(todo)
    stats.total = len(todo)

    api_key = args.api_key or os.environ.get("VLMSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not todo:
        if not args.quiet:
            _eprint(summary(stats, str(out)))
        if not out.exists():
            RecordWriter(out, fmt).close()  # an empty (CSV: header-only) output, so scripts find the file
        return EXIT_OK

    with contextlib.ExitStack() as stack:
        if args.in_process:
            from vlmserve.caption.inprocess import in_process_server

            if not args.quiet:
                _eprint(f"caption: loading {args.in_process} in-process ...")
            try:
                url, model_id = stack.enter_context(in_process_server(args.in_process, api_key=api_key))
            except RuntimeError as exc:
                _eprint(f"caption: {exc}")
                return EXIT_USAGE
            servers, model, concurrency = [url], args.model or model_id, args.concurrency or 32
        else:
            servers, model, concurrency = _servers(args), args.model, args.concurrency or 16
        opts = _options(args, prompt, extra, servers, model, concurrency, api_key)
        writer = RecordWriter(out, fmt, fsync_every=args.fsync_every)
        progress = Progress(stats, args.progress, quiet=args.quiet)
        stats.started = time.monotonic()
        try:
            asyncio.run(Runner(todo, writer, opts, stats, progress).run())
        except RuntimeError as exc:  # model discovery failed
            progress.close()
            _eprint(f"caption: {exc}")
            return EXIT_USAGE
        except KeyboardInterrupt:
            stats.interrupted = True
        finally:
            progress.close()
            writer.close()
    if not args.quiet:
        _eprint(summary(stats, str(out)))
    if stats.fatal:
        return EXIT_USAGE
    if stats.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if stats.failed else EXIT_OK


def main(argv: list[str] | None = None, hard_exit: bool = False) -> int:
    """Entry point for `vlmserve caption` and scripts/caption.py; returns the exit status.

    hard_exit: leave with os._exit once the output is closed (scripts: MLX's C++ teardown after an
    --in-process run can abort at interpreter exit; there is nothing left to clean up by then).
    """
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except KeyboardInterrupt:
        _eprint("caption: interrupted")
        code = EXIT_INTERRUPTED
    if hard_exit and args.in_process:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code
