"""Output records: JSONL or CSV, one whole line per image, flushed per record, fsync'd periodically.

Resume reads the file back, keeps the successful rows, and repairs the file when it must: a
trailing partial line (hard kill, power loss), undecodable lines, failed rows (they are retried)
and duplicates are dropped by rewriting the file atomically (temp file + fsync + rename), so a
finished run always holds exactly one row per image.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

FIELDS = (
    "path",
    "prompt",
    "caption",
    "model",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "latency_s",
    "server",
    "attempts",
    "error",
)


def format_for(out: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    return "csv" if Path(out).suffix.lower() in (".csv",) else "jsonl"


def record_key(row: dict) -> tuple[str, str]:
    return (str(row.get("path") or ""), str(row.get("prompt") or ""))


def is_success(row: dict) -> bool:
    return not row.get("error") and row.get("caption") is not None


# ---- encoding ---------------------------------------------------------------------------------
def encode_jsonl(row: dict) -> bytes:
    clean = {k: v for k, v in row.items() if v is not None or k in ("caption", "error")}
    if not clean.get("prompt"):
        clean.pop("prompt", None)  # only per-row prompts are recorded (they are part of the key)
    try:
        return (json.dumps(clean, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not UTF-8 (a lone surrogate): escaped, it reads back the same
        return (json.dumps(clean) + "\n").encode("ascii")


def encode_csv(row: dict) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if row.get(k) is None else row.get(k) for k in FIELDS])
    # A file name that is not UTF-8 keeps its undecodable bytes as they were (os.fsencode's way).
    return buf.getvalue().encode("utf-8", errors="surrogateescape")


def _csv_header() -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(FIELDS)
    return buf.getvalue().encode("utf-8")


def _csv_value(name: str, value: str):
    if value == "":
        return None if name != "caption" else ""
    if name in ("prompt_tokens", "completion_tokens", "attempts"):
        try:
            return int(value)
        except ValueError:
            return value
    if name == "latency_s":
        try:
            return float(value)
        except ValueError:
            return value
    return value


# ---- reading back (resume) ------------------------------------------------------------------------
@dataclass
class Existing:
    rows: list[dict] = field(default_factory=list)  # successful rows, first per key, in file order
    failed: int = 0  # failed rows dropped (retried now)
    duplicates: int = 0
    corrupt: int = 0  # undecodable complete lines dropped
    partial_tail: bool = False  # an incomplete last line was dropped
    needs_rewrite: bool = False

    @property
    def done_keys(self) -> set[tuple[str, str]]:
        return {record_key(r) for r in self.rows}


def _collect(existing: Existing, rows: list[dict]) -> Existing:
    seen: set[tuple[str, str]] = set()
    for row in rows:
        if not is_success(row):
            existing.failed += 1
        elif record_key(row) in seen:
            existing.duplicates += 1
        else:
            seen.add(record_key(row))
            existing.rows.append(row)
    existing.needs_rewrite = bool(existing.failed or existing.duplicates or existing.corrupt or existing.partial_tail)
    return existing


def read_jsonl(data: bytes) -> Existing:
    existing = Existing()
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        existing.partial_tail = True  # no newline: the last write never finished
    rows = []
    for line in lines[:-1]:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "path" not in row:
                raise ValueError
            rows.append(row)
        except (ValueError, UnicodeDecodeError):
            existing.corrupt += 1
    return _collect(existing, rows)


def read_csv(data: bytes) -> Existing:
    existing = Existing()
    text = data.decode("utf-8", errors="surrogateescape")  # as encode_csv wrote it
    if not text:
        return existing
    if not text.endswith("\n"):
        existing.partial_tail = True
        text = text[: text.rfind("\n") + 1]  # a record is written whole, newline last: no newline, no record
    # Records end at "\n" only: str.splitlines would also split at U+2028, form feeds and the
    # like, which the writer leaves unquoted inside a cell.
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows, header = [], None
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error:  # e.g. an unterminated quote cut at an embedded newline
            existing.corrupt += 1
            break
        if header is None:
            header = cells
            if "path" not in header:
                raise ValueError("the existing CSV output has no 'path' column")
            continue
        if len(cells) != len(header):
            existing.corrupt += 1
            continue
        rows.append({k: _csv_value(k, v) for k, v in zip(header, cells)})
    if header is None:
        existing.partial_tail = existing.partial_tail or bool(text)
    return _collect(existing, rows)


def load_existing(path: Path, fmt: str) -> Existing:
    if not path.exists() or path.stat().st_size == 0:
        return Existing()
    data = path.read_bytes()
    return read_csv(data) if fmt == "csv" else read_jsonl(data)


# ---- writing ------------------------------------------------------------------------------------------
class RecordWriter:
    """Appends whole records; flush after each (a killed process loses nothing the OS has), fsync
    every `fsync_every` seconds and on close (a crashed machine loses at most that much)."""

    def __init__(self, path: Path, fmt: str, fsync_every: float = 2.0):
        self.path, self.fmt, self.fsync_every = path, fmt, fsync_every
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._last_sync = time.monotonic()
        if fmt == "csv" and self.f.tell() == 0:
            self._write(_csv_header())

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # one write() normally; loop on short writes
            n = self.f.write(view)
            view = view[n:]

    def write(self, row: dict) -> None:
        self._write(encode_csv(row) if self.fmt == "csv" else encode_jsonl(row))
        if time.monotonic() - self._last_sync >= self.fsync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.f.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self.f.closed:
            try:
                self.sync()
            finally:
                self.f.close()


def rewrite(path: Path, fmt: str, rows: list[dict]) -> None:
    """Replace the file with exactly `rows`, atomically (a crash leaves the old or the new file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if fmt == "csv":
            f.write(_csv_header())
        for row in rows:
            f.write(encode_csv(row) if fmt == "csv" else encode_jsonl(row))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
