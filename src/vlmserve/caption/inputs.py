"""INPUT arguments -> the ordered list of images to caption (paths, URLs, per-row prompts)."""

from __future__ import annotations

import csv
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
LIST_JSONL = frozenset({".jsonl", ".ndjson"})
LIST_CSV = frozenset({".csv", ".tsv"})
PATH_COLUMNS = ("path", "url", "image", "image_url", "image_path", "file", "filename", "file_name")
GLOB_CHARS = frozenset("*?[")


class InputError(ValueError):
    """An INPUT that cannot be read or understood (reported, exit code 2)."""


@dataclass(frozen=True)
class Item:
    """One image to caption.

    `path` is recorded in the output exactly as the input named it (the path as found under a
    directory / glob, or the list file's cell); `source` is what is read or sent (a local file
    path resolved against the list file's folder, or a URL passed through unchanged).
    `prompt` is a per-row prompt (None: the run's --prompt).
    """

    path: str
    source: str
    prompt: str | None = None

    @property
    def is_url(self) -> bool:
        return is_url(self.source)

    @property
    def key(self) -> tuple[str, str]:
        """Identity for resume and de-duplication: the same image with another prompt is another row."""
        return (self.path, self.prompt or "")


def is_url(text: str) -> bool:
    low = text[:8].lower()
    return low.startswith(("http://", "https://", "data:"))


def _walk(directory: Path) -> list[Item]:
    """Image files under `directory`, symlinked folders followed once each (a link back up the
    tree would otherwise repeat everything under it without end)."""
    found = []
    visited: set[tuple[int, int]] = set()

    def unreadable(exc: OSError) -> None:
        raise InputError(f"{exc.filename}: cannot list the folder: {exc.strerror or exc}")

    for root, dirs, files in os.walk(directory, followlinks=True, onerror=unreadable):
        here = os.stat(root)
        if (here.st_dev, here.st_ino) in visited:
            dirs[:] = []
            continue
        visited.add((here.st_dev, here.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                p = os.path.join(root, name)
                found.append(Item(p, p))
    return found


def _resolve(cell: str, base: Path) -> Item:
    cell = cell.strip()
    if is_url(cell):
        return Item(cell, cell)
    if cell.lower().startswith("file://"):
        local = cell[7:]
        return Item(cell, local)
    p = Path(os.path.expanduser(cell))
    if not p.is_absolute():
        beside = base / p
        # Relative paths are relative to the list file's folder (like most dataset manifests),
        # falling back to the working directory.
        p = beside if beside.exists() or not p.exists() else p
    return Item(cell, str(p))


def _row_item(row: dict, where: str, base: Path, path_column: str | None, prompt_column: str) -> Item | None:
    """The row's image, or None for a row without one (the caller counts it)."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with a path/url field")
    columns = (path_column,) if path_column else PATH_COLUMNS
    cell = next((row[c] for c in columns if isinstance(row.get(c), str) and row[c].strip()), None)
    if cell is None:
        if path_column is None and not any(c in row for c in PATH_COLUMNS):
            raise InputError(f"{where}: no path column (one of {', '.join(PATH_COLUMNS)}; or pass --path-column)")
        return None  # an empty cell: skip the row
    item = _resolve(cell, base)
    prompt = row.get(prompt_column)
    if isinstance(prompt, str) and prompt.strip():
        item = Item(item.path, item.source, prompt)
    return item


def _read_jsonl(path: Path, path_column: str | None, prompt_column: str, skipped: list[str]) -> list[Item]:
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            if isinstance(row, str):
                row = {"path": row}
            item = _row_item(row, f"{path}:{n}", path.parent, path_column, prompt_column)
            if item:
                items.append(item)
            else:
                skipped.append(f"{path}:{n}")
    return items


def _read_csv(path: Path, path_column: str | None, prompt_column: str, skipped: list[str]) -> list[Item]:
    items = []
    csv.field_size_limit(_CSV_CELL_LIMIT)  # a data: URI cell outgrows the module's 128 KB default
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        try:
            if path_column and path_column not in (reader.fieldnames or []):
                raise InputError(
                    f"{path}: no column {path_column!r} (its columns: {', '.join(reader.fieldnames or [])})"
                )
            for row in reader:
                item = _row_item(row, f"{path}:{reader.line_num}", path.parent, path_column, prompt_column)
                if item:
                    items.append(item)
                else:
                    skipped.append(f"{path}:{reader.line_num}")
        except csv.Error as exc:
            raise InputError(f"{path}:{reader.line_num}: {exc}") from None
    return items


_CSV_CELL_LIMIT = 1 << 30  # the largest cell a manifest may hold


def _read_list(path: Path) -> list[Item]:
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                items.append(_resolve(line, path.parent))
    return items


def discover(
    inputs: list[str], path_column: str | None = None, prompt_column: str = "prompt", skipped: list[str] | None = None
) -> list[Item]:
    """Expand every INPUT in order: a directory (recursive, image extensions), a glob, a text file
    of paths/URLs, a JSONL/CSV/TSV manifest with a path/url column and optional prompt column,
    a single image file, or an http(s)/data URL. Manifest rows without a path are left out and
    named in `skipped` (file:line)."""
    items: list[Item] = []
    skipped = [] if skipped is None else skipped
    for arg in inputs:
        p = Path(os.path.expanduser(arg))
        if is_url(arg):
            items.append(Item(arg, arg))
        elif p.is_dir():
            items.extend(_walk(p))
        elif p.is_file():
            suffix = p.suffix.lower()
            if suffix in IMAGE_EXTENSIONS:
                items.append(Item(arg, str(p)))
            elif suffix in LIST_JSONL:
                items.extend(_read_jsonl(p, path_column, prompt_column, skipped))
            elif suffix in LIST_CSV:
                items.extend(_read_csv(p, path_column, prompt_column, skipped))
            else:
                items.extend(_read_list(p))
        elif GLOB_CHARS & set(arg):
            matches = sorted(m for m in glob.glob(os.path.expanduser(arg), recursive=True) if os.path.isfile(m))
            if not matches:
                raise InputError(f"{arg}: the pattern matched no files")
            items.extend(Item(m, m) for m in matches)
        else:
            raise InputError(f"{arg}: no such file, directory or URL")
    return items


def skipped_note(skipped: list[str]) -> str:
    """The report of manifest rows left out for having no path (file:line, the first few)."""
    more = ", ..." if len(skipped) > 3 else ""
    return f"caption: {len(skipped)} manifest rows without a path left out ({', '.join(skipped[:3])}{more})"


def dedupe(items: list[Item]) -> tuple[list[Item], int]:
    """Keep the first of each (path, prompt); return the rest's count."""
    seen: set[tuple[str, str]] = set()
    out = []
    for item in items:
        if item.key not in seen:
            seen.add(item.key)
            out.append(item)
    return out, len(items) - len(out)
