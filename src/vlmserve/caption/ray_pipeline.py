"""Captioning on a Ray cluster: Ray Data feeds the images to a pool of actors, each running a
vlmserve engine in its own process (one per host or GPU), and the driver writes the rows.

The rows are those of the plain tool (output.FIELDS), written as they arrive (JSONL, CSV) or
at the end (Parquet), so `--resume` skips what an earlier run wrote, whichever way it ran.
Each actor captions its batch with the plain tool's Runner against its own in-process server:
the same request, retries and per-row errors. Ray restarts an actor that dies and retries its
batch.

    from vlmserve.caption.ray_pipeline import RayOptions, caption_on_ray
    caption_on_ray(["photos/"], "captions.jsonl", RayOptions(model="mlx-community/...", num_replicas=4))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vlmserve.caption.inputs import Item, dedupe, discover, skipped_note
from vlmserve.caption.output import FIELDS, RecordWriter, format_for, is_success, load_existing, rewrite
from vlmserve.caption.payload import data_uri
from vlmserve.caption.progress import Progress, Stats
from vlmserve.caption.runner import Options, Runner

_TABLE_PATH_COLUMNS = ("path", "url", "image_path", "file")
_TABLE_BYTES_COLUMNS = ("image", "bytes", "image_bytes")


@dataclass
class RayOptions:
    model: str  # what each actor loads: a local directory or a Hugging Face id
    address: str | None = None  # a running cluster ("auto", "host:port"); None: a local one
    num_replicas: int = 1  # actors, each with its own engine
    actor_cpus: float = 1.0
    actor_gpus: float = 0.0
    batch_size: int = 32  # images handed to an actor at a time
    max_num_seqs: int | None = None  # each engine's batch (None: the server's default)
    request: Options = field(default_factory=lambda: Options(servers=[], prompt="Describe this image."))
    path_column: str | None = None
    prompt_column: str = "prompt"
    resume: bool = False
    progress: bool | None = None
    quiet: bool = False


class _Collect:
    """A RecordWriter stand-in that keeps the rows (an actor hands them back to Ray)."""

    def __init__(self):
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)

    def close(self) -> None:
        pass


class CaptionActor:
    """One vlmserve engine, in this actor's process, behind the plain tool's Runner."""

    def __init__(self, model: str, request: dict, max_num_seqs: int | None):
        from vlmserve.caption.inprocess import in_process_server

        self._stack = contextlib.ExitStack()
        url, model_id = self._stack.enter_context(in_process_server(model, max_num_seqs=max_num_seqs))
        self.options = Options(**{**request, "servers": [url], "model": request.get("model") or model_id})

    def __call__(self, batch: dict) -> dict:
        items = [
            Item(path=str(p), source=str(s), prompt=(str(q) if q else None))
            for p, s, q in zip(batch["path"], batch["source"], batch["prompt"])
        ]
        collect = _Collect()
        stats = Stats(total=len(items))
        asyncio.run(Runner(items, collect, self.options, stats, Progress(stats, False, quiet=True)).run())
        return {name: [row.get(name) for row in collect.rows] for name in FIELDS}


def _table_items(path: str, opts: RayOptions, ray_data) -> list[Item]:
    """A Parquet table's rows: a path/URL column, or image bytes (sent as a data URI)."""
    table = ray_data.read_parquet(path).to_pandas()
    columns = [opts.path_column] if opts.path_column else [c for c in _TABLE_PATH_COLUMNS if c in table.columns]
    blobs = [c for c in _TABLE_BYTES_COLUMNS if c in table.columns]
    if not columns and not blobs:
        raise ValueError(f"{path}: no image column (one of {_TABLE_PATH_COLUMNS + _TABLE_BYTES_COLUMNS})")
    items = []
    for i, row in enumerate(table.to_dict("records")):
        prompt = row.get(opts.prompt_column) or None
        if columns:
            cell = str(row[columns[0]])
            source = cell if "://" in cell or Path(cell).is_absolute() else str(Path(path).parent / cell)
            items.append(Item(path=cell, source=source, prompt=prompt))
        else:
            data = row[blobs[0]]
            name = str(row.get("id", f"{Path(path).name}#{i}"))
            items.append(Item(path=name, source=data_uri(bytes(data), name), prompt=prompt))
    return items


def _discover(inputs: list[str], opts: RayOptions, ray_data) -> tuple[list[Item], int]:
    tables = [i for i in inputs if i.lower().endswith(".parquet")]
    others = [i for i in inputs if i not in tables]
    skipped: list[str] = []
    items = discover(others, opts.path_column, opts.prompt_column, skipped) if others else []
    if skipped:  # as the single-machine run reports them
        print(skipped_note(skipped), file=sys.stderr)
    for table in tables:
        items += _table_items(table, opts, ray_data)
    return dedupe(items)


def _write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in FIELDS} for r in rows]), tmp)
    tmp.replace(path)


def _existing_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for r in pq.read_table(path).to_pylist() if is_success(r)] if path.exists() else []


def caption_on_ray(inputs: list[str], out: str, opts: RayOptions, fmt: str | None = None) -> Stats:
    """Caption `inputs` (folders, globs, lists, JSONL/CSV manifests, Parquet tables) into `out`
    (.jsonl, .csv or .parquet) on a Ray cluster; returns the run's counts."""
    import ray

    fmt = fmt or ("parquet" if out.lower().endswith(".parquet") else format_for(out, None))
    target = Path(out)
    if target.exists() and target.stat().st_size and not opts.resume:
        raise FileExistsError(f"{out} exists; resume it or remove it")
    ray.init(address=opts.address, ignore_reinit_error=True, log_to_driver=False)
    if opts.quiet or opts.progress is False:  # Ray Data's own progress lines too
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    items, duplicates = _discover(inputs, opts, ray.data)
    kept: list[dict] = []
    if opts.resume and target.exists():
        if fmt == "parquet":
            kept = _existing_parquet(target)
            done = {(r["path"], r.get("prompt") or "") for r in kept}
        else:
            existing = load_existing(target, fmt)
            if existing.needs_rewrite:
                rewrite(target, fmt, existing.rows)
            done = existing.done_keys
        items = [it for it in items if it.key not in done]
    stats = Stats(duplicates=duplicates, total=len(items))
    stats.skipped = len(kept)
    progress = Progress(stats, opts.progress, quiet=opts.quiet)
    rows: list[dict] = []
    writer = RecordWriter(target, fmt) if fmt != "parquet" else None
    try:
        if items:
            request = {
                f.name: getattr(opts.request, f.name) for f in dataclasses.fields(Options) if f.name != "servers"
            }
            dataset = ray.data.from_items(
                [{"path": i.path, "source": i.source, "prompt": i.prompt or ""} for i in items]
            )
            captions = dataset.map_batches(
                CaptionActor,
                fn_constructor_kwargs={"model": opts.model, "request": request, "max_num_seqs": opts.max_num_seqs},
                batch_size=opts.batch_size,
                concurrency=opts.num_replicas,
                num_cpus=opts.actor_cpus,
                num_gpus=opts.actor_gpus,
                max_restarts=3,
                max_task_retries=3,
            )
            for row in captions.iter_rows():
                row = {k: row.get(k) for k in FIELDS}
                if is_success(row):
                    stats.done += 1
                    stats.prompt_tokens += row.get("prompt_tokens") or 0
                    stats.completion_tokens += row.get("completion_tokens") or 0
                else:
                    stats.failed += 1
                progress.advance()
                if writer is not None:
                    writer.write(row)
                else:
                    rows.append(row)
        if writer is None:
            _write_parquet(target, kept + rows)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    return stats
