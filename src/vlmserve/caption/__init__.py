"""Batch captioning client: caption thousands of images through one or more OpenAI-compatible servers.

`python scripts/caption.py INPUT... --out captions.jsonl` or `vlmserve caption ...`. See docs/captioning.md.
Nothing here imports MLX; only `--in-process` loads the engine (lazily, in `inprocess.py`).
"""

from __future__ import annotations

from vlmserve.caption.cli import add_arguments, build_parser, main

__all__ = ["add_arguments", "build_parser", "main"]
