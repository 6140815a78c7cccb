"""The asyncio run: a shared queue, `concurrency` workers per server, retries, one writer, clean stop."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field

import httpx

from vlmserve.caption.client import Outcome, discover_model, post_chat
from vlmserve.caption.inputs import Item
from vlmserve.caption.output import RecordWriter
from vlmserve.caption.payload import chat_body, read_image_url
from vlmserve.caption.progress import Progress, Stats
from vlmserve.caption.retry import backoff_delay


@dataclass
class Options:
    servers: list[str]
    prompt: str
    model: str | None = None
    max_tokens: int | None = 256
    temperature: float | None = None
    concurrency: int = 16  # per server
    retries: int = 5  # retries after the first attempt
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    timeout: float = 600.0
    give_up_after: float = 300.0  # every server failing this long: the run stops (resumable)
    api_key: str | None = None
    detail: str | None = None
    system: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class _Server:
    url: str
    model: str
    client: httpx.AsyncClient
    failures: int = 0  # consecutive retriable failures
    failing_since: float | None = None  # when they began
    cool_until: float = 0.0

    async def wait_healthy(self) -> None:
        delay = self.cool_until - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass
class _Entry:
    item: Item
    attempts: int = 0
    last_error: str | None = None


class Runner:
    def __init__(self, items: list[Item], writer: RecordWriter, opts: Options, stats: Stats, progress: Progress):
        self.items, self.writer, self.opts, self.stats, self.progress = items, writer, opts, stats, progress
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.queue: asyncio.Queue[_Entry] = asyncio.Queue()
        self.pending = len(items)
        self.finished = asyncio.Event()  # every item has its row, or we are stopping
        self._timers: list[asyncio.TimerHandle] = []
        self.servers: list[_Server] = []
        self.warn = progress.write

    # ---- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        if not self.items:
            return
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.interrupt)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
                pass
        try:
            self.servers = await self._open_servers()
            for item in self.items:
                self.queue.put_nowait(_Entry(item))
            workers = [
                asyncio.create_task(self._worker(s), name=f"caption-{s.url}-{i}")
                for s in self.servers
                for i in range(self.opts.concurrency)
            ]
            ticker = asyncio.create_task(self._tick())
            try:
                await self.finished.wait()
            finally:
                for task in (*workers, ticker):
                    task.cancel()  # in-flight requests are abandoned (not written); --resume redoes them
                await asyncio.gather(*workers, ticker, return_exceptions=True)
                for timer in self._timers:
                    timer.cancel()
        finally:
            for s in self.servers:
                await s.client.aclose()
            for sig in installed:
                loop.remove_signal_handler(sig)

    def interrupt(self) -> None:
        self.stats.interrupted = True
        self.finished.set()

    def _stop_fatal(self, reason: str) -> None:
        if self.stats.fatal is None:
            self.stats.fatal = reason
        self.finished.set()

    async def _open_servers(self) -> list[_Server]:
        opts = self.opts
        servers = []
        for url in opts.servers:
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(opts.timeout, connect=min(30.0, opts.timeout)),
                limits=httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency),
            )
            servers.append(_Server(url, opts.model or "", client))
        if not opts.model:
            models = await asyncio.gather(
                *(
                    discover_model(s.client, s.url, self.headers, delay=min(opts.backoff_base, opts.backoff_max))
                    for s in servers
                ),
                return_exceptions=True,
            )
            alive = []
            for s, m in zip(servers, models):
                if isinstance(m, BaseException):
                    await s.client.aclose()
                    self.warn(f"caption: skipping {s.url}: {m}")
                    last_error = m
                else:
                    s.model = m
                    alive.append(s)
            if not alive:
                raise RuntimeError(str(last_error))
            servers = alive
        return servers

    async def _tick(self) -> None:
        while True:  # keeps the bar's rate/ETA moving while requests are slow
            await asyncio.sleep(1.0)
            self.progress.refresh()

    # ---- work -----------------------------------------------------------------------------------
    async def _worker(self, server: _Server) -> None:
        while True:
            await server.wait_healthy()
            entry = await self.queue.get()
            await server.wait_healthy()  # it may have turned unwell while this worker waited for work
            try:
                await self._attempt(server, entry)
            except Exception as exc:  # noqa: BLE001 - an odd input or answer costs its row, never the run
                self._fail(entry, server, f"{type(exc).__name__}: {exc}")

    def _fail(self, entry: _Entry, server: _Server, error: str) -> None:
        """The image's error row; where even that cannot be written (the output's disk), the run stops."""
        try:
            self._record(entry, server, Outcome(False, error=error))
        except Exception as exc:  # noqa: BLE001
            self._stop_fatal(f"cannot write {entry.item.path!r} to the output: {type(exc).__name__}: {exc}")

    def _all_down_for(self, now: float) -> float:
        """How long every server has been failing (0: one of them is not)."""
        since = [s.failing_since for s in self.servers]
        return 0.0 if any(t is None for t in since) else now - max(since)

    async def _attempt(self, server: _Server, entry: _Entry) -> None:
        opts, item = self.opts, entry.item
        entry.attempts += 1
        prompt = item.prompt or opts.prompt
        try:
            url = await asyncio.to_thread(read_image_url, item)
        except OSError as exc:  # missing/unreadable file: no server can help
            self._record(entry, server, Outcome(False, error=f"cannot read {item.source}: {exc.strerror or exc}"))
            return
        body = chat_body(
            server.model, url, prompt, opts.max_tokens, opts.temperature, opts.detail, opts.system, opts.extra
        )
        del url
        outcome = await post_chat(server.client, server.url, body, self.headers)
        self.stats.per_server[server.url] += 1
        if outcome.ok:
            server.failures, server.failing_since = 0, None
            self._record(entry, server, outcome)
        elif outcome.fatal:
            self._stop_fatal(f"{server.url}: {outcome.error}")
        elif outcome.retriable and entry.attempts <= opts.retries:
            now = time.monotonic()
            server.failures += 1
            if server.failing_since is None:
                server.failing_since = now
            down = self._all_down_for(now)
            if down >= opts.give_up_after:
                self._stop_fatal(f"no server answered for {down:.0f} s (last: {server.url}: {outcome.error})")
                return
            delay = backoff_delay(entry.attempts, opts.backoff_base, opts.backoff_max, outcome.retry_after)
            # The server is unwell: its workers pause, so the others (if any) take the work meanwhile.
            pause = backoff_delay(server.failures, opts.backoff_base, opts.backoff_max, outcome.retry_after)
            server.cool_until = max(server.cool_until, time.monotonic() + pause)
            entry.last_error = outcome.error
            self.stats.retries += 1
            loop = asyncio.get_running_loop()
            self._timers.append(loop.call_later(delay, self.queue.put_nowait, entry))
            if len(self._timers) > 4096:
                self._timers = [t for t in self._timers if not t.cancelled() and t.when() > loop.time()]
        else:
            self._record(entry, server, outcome)

    def _record(self, entry: _Entry, server: _Server, outcome: Outcome) -> None:
        item = entry.item
        row = {
            "path": item.path,
            "prompt": item.prompt,
            "caption": outcome.caption if outcome.ok else None,
            "model": outcome.model or server.model or None,
            "finish_reason": outcome.finish_reason,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "latency_s": round(outcome.latency_s, 4),
            "server": server.url,
            "attempts": entry.attempts,
            "error": None if outcome.ok else outcome.error,
        }
        self.writer.write(row)
        if outcome.ok:
            self.stats.done += 1
            self.stats.prompt_tokens += outcome.prompt_tokens or 0
            self.stats.completion_tokens += outcome.completion_tokens or 0
        else:
            self.stats.failed += 1
        self.progress.advance()
        self.pending -= 1
        if self.pending <= 0:
            self.finished.set()
