"""Paths and calls shared by the caption tests (unit/caption, e2e/caption)."""

from __future__ import annotations

import json
from pathlib import Path

from support.helpers import ROOT

SCRIPT = ROOT / "scripts" / "caption.py"
FIXTURE_IMAGES = ROOT / "fixtures" / "images"
QWEN = ROOT / "fixtures" / "models" / "qwen2_vl"
FAST = ["--backoff", "0.01", "--backoff-max", "0.05", "--no-progress"]


def read_jsonl(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the output must end with a whole line"
    return [json.loads(line) for line in raw.decode().splitlines()]


def caption(*argv: str) -> int:
    from vlmserve.caption import main

    return main([str(a) for a in argv])
