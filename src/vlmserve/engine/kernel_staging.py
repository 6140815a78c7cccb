"""Processes that build GPU kernels beside the engine, each into a kernel cache of its own.

MLX writes a kernel into its cache (MLX_PTX_CACHE_DIR) in place, three files one after another,
and a process reads one whenever it first needs it: an engine reading a module while a build
process writes the same one would read half a file. So each build process gets a directory of
its own, seeded with links to what the shared cache holds (those it need not build), and what
it built moves into the shared cache by renames once it exits (or, for a process that files its
own builds as it goes, as each is built): each module's kernel names (.txt) before its binary
(.ptx), the file MLX looks for. No MLX import here.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


SIDE_PROCESSES = max(1, min(8, (os.cpu_count() or 2) // 2))  # build processes at once, leaving cores to the engine


def _rank(path: Path) -> int:
    """Publishing order: a module's kernel names, its source, anything else, its binary last."""
    return {".txt": 0, ".cu": 1, ".ptx": 3}.get(path.suffix, 2)


def staging_root(shared: Path) -> Path:
    """Where build processes' own directories live: beside the cache (same file system, so moves
    are renames), not in it."""
    return shared.parent / f"{shared.name}.staging"


STALE_S = 3600.0  # a private cache this old belongs to no running build (theirs stop at 240 s)


def remove_stale(shared: Path) -> int:
    """Remove private caches left by builds whose engine was killed before it could; returns how many."""
    root, removed = staging_root(shared), 0
    if root.is_dir():
        for private in root.iterdir():
            try:
                stale = time.time() - private.stat().st_mtime > STALE_S
            except OSError:
                continue
            if stale:
                shutil.rmtree(private, ignore_errors=True)
                removed += 1
    return removed


def make_private(shared: Path, tag: str, seed: bool = True) -> Path:
    """A new directory, with `seed` holding hard links (copies where links fail) to the shared cache's files."""
    root = staging_root(shared)
    root.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=root))
    if seed:
        link_missing(shared, private)
    return private


def link_missing(shared: Path, private: Path, copy: bool = False) -> None:
    """Give `private` the shared cache's files it lacks, each module's names before its binary:
    hard links, or (`copy`, for a process that already runs) copies, so that MLX writing a module
    there that it compiled meanwhile writes its own file, never the shared one's."""
    if not shared.is_dir():
        return
    for src in sorted((f for f in shared.rglob("*") if f.is_file()), key=_rank):
        dst = private / src.relative_to(shared)
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not copy:
            try:
                os.link(src, dst)
                continue
            except FileExistsError:  # its process built this one meanwhile
                continue
            except OSError:
                pass
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)


def publish(private: Path, shared: Path) -> int:
    """Move what `private` holds and `shared` lacks into `shared`, each file by an atomic rename
    and every binary after its names; returns the files moved. A file another process published
    first stays as it is (same name, same kernel)."""
    new = []
    for src in private.rglob("*"):
        if src.is_file():
            dst = shared / src.relative_to(private)
            if not dst.exists():
                new.append((src, dst))
    new.sort(key=lambda pair: _rank(pair[0]))
    for src, dst in new:
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(src, dst)
        except OSError:  # another file system: copy beside the target, then rename
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
    return len(new)


class StagedBuild:
    """`python -m <module> <args>` with MLX_PTX_CACHE_DIR set to a directory of its own (`seed`:
    holding what the shared cache holds, so the process does not build it again)."""

    def __init__(self, module: str, args: list[str], shared: Path, tag: str, seed: bool = True):
        self.shared = shared
        self.started = time.monotonic()
        self.private = make_private(shared, tag, seed)
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(self.private))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError:
            self.discard()
            raise

    def done(self) -> bool:
        """Whether the process has exited (`finish` then returns at once)."""
        return self.proc.poll() is not None

    def finish(self, timeout: float) -> bool:
        """Wait up to `timeout` s (then stop it); publish what a successful run built. True: it succeeded."""
        try:
            _, err = self.proc.communicate(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            return False
        ok = self.proc.returncode == 0
        if ok:
            try:
                publish(self.private, self.shared)
            except OSError:
                log.warning("could not file built kernels in %s", self.shared, exc_info=True)
                ok = False
        else:
            log.warning(
                "a kernel build process failed (exit %s): %s",
                self.proc.returncode,
                (err or b"").decode(errors="replace")[-800:],
            )
        self.discard()
        return ok

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)


class Finishing(Protocol):
    def finish(self, timeout: float) -> bool: ...


def finish_all(builds: Sequence[Finishing], timeout: float) -> tuple[int, float]:
    """Wait for every build (at most `timeout` s in all); returns (how many failed or were stopped, seconds waited)."""
    t0 = time.perf_counter()
    failed = sum(not b.finish(timeout - (time.perf_counter() - t0)) for b in builds)
    return failed, time.perf_counter() - t0
