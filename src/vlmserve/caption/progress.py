"""Counters, the progress bar (tqdm: done/failed, images/s, ETA) and the end-of-run summary."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    total: int = 0  # images this run will attempt (after resume skips)
    done: int = 0
    failed: int = 0
    skipped: int = 0  # already captioned in the output (--resume)
    duplicates: int = 0  # repeated (path, prompt) in the input, captioned once
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_server: Counter = field(default_factory=Counter)  # requests answered (any status) per server
    started: float = field(default_factory=time.monotonic)
    interrupted: bool = False
    fatal: str | None = None

    @property
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.started)

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.failed


class Progress:
    """A tqdm bar on a terminal; otherwise (logs, batch jobs) a status line every `log_every` seconds.
    quiet: neither."""

    def __init__(self, stats: Stats, enabled: bool | None, quiet: bool = False, log_every: float = 60.0):
        self.stats = stats
        self.bar = None
        self.quiet = quiet
        self.log_every = log_every
        self._last_log = time.monotonic()
        if enabled is None:
            enabled = sys.stderr.isatty()
        enabled = enabled and not quiet
        if enabled and stats.total:
            from tqdm import tqdm

            self.bar = tqdm(total=stats.total, unit="img", dynamic_ncols=True, smoothing=0.05, file=sys.stderr)
            self._postfix()

    def _postfix(self) -> None:
        s = self.stats
        self.bar.set_postfix_str(f"ok={s.done} failed={s.failed} retries={s.retries}", refresh=False)

    def advance(self) -> None:
        if self.bar is not None:
            self._postfix()
            self.bar.update(1)

    def refresh(self) -> None:
        if self.bar is not None:
            self._postfix()
            self.bar.refresh()
        elif not self.quiet and time.monotonic() - self._last_log >= self.log_every:
            self._last_log = time.monotonic()
            s = self.stats
            n = s.done + s.failed
            rate = n / s.elapsed
            eta = f"{s.remaining / rate / 60:.1f} min" if rate > 0 else "?"
            print(
                f"caption: {n}/{s.total} ({s.done} ok, {s.failed} failed, {s.retries} retries), "
                f"{rate:.2f} images/s, ETA {eta}",
                file=sys.stderr,
                flush=True,
            )

    def write(self, message: str) -> None:
        """A message that does not tear the bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        elif not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(stats: Stats, out: str) -> str:
    s = stats
    rate = (s.done + s.failed) / s.elapsed
    lines = [
        f"caption: {'interrupted' if s.interrupted else 'stopped: ' + s.fatal if s.fatal else 'finished'} "
        f"in {s.elapsed:.1f} s -> {out}",
        f"  done {s.done}, failed {s.failed}, skipped {s.skipped} (already in the output)"
        + (f", duplicates {s.duplicates}" if s.duplicates else "")
        + (f", not attempted {s.remaining}" if s.remaining else ""),
        f"  {rate:.2f} images/s, {s.retries} retries, tokens: {s.prompt_tokens} prompt + "
        f"{s.completion_tokens} completion ({s.completion_tokens / s.elapsed:.1f} completion tok/s)",
    ]
    if len(s.per_server) > 1:
        lines.append("  requests per server: " + ", ".join(f"{k} {v}" for k, v in sorted(s.per_server.items())))
    if s.failed:
        lines.append("  failed rows have an 'error'; rerun with --resume to retry them")
    elif s.remaining:
        lines.append("  rerun the same command with --resume to continue")
    return "\n".join(lines)
