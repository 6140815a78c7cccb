"""`vlmserve serve`'s logging: records are queued by the threads that log and written by one thread.

Written where they are made, each record is a write() on the event loop (the request lines, and
uvicorn's access lines, come 64 at a time at c=64): a system call that releases the GIL, which
the loop may then wait a switch interval to get back from the MLX thread. The stdlib's
QueueHandler/QueueListener pair moves the write to a thread of its own.
"""

from __future__ import annotations

import logging
import queue
from logging.handlers import QueueHandler, QueueListener

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _uvicorn_name(record: logging.LogRecord) -> bool:
    if record.name == "uvicorn.error":  # uvicorn's general logger: "Started server process", not errors
        record.name = "uvicorn"
    return True


class RepeatLimit(logging.Filter):
    """At most `burst` records of one kind (logger, level and message template) per `window`
    seconds; then one line saying how many were dropped. A flood of one error (accept() failing
    at the open-file limit, a client population hammering a bad route) otherwise grew the log by
    megabytes a second and cost the event loop a write each."""

    def __init__(self, burst: int = 20, window: float = 10.0):
        super().__init__()
        self.burst, self.window = burst, window
        self._seen: dict[tuple, list] = {}  # kind -> [window start, count]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = record.created
        entry = self._seen.get(kind)
        if entry is None or now - entry[0] >= self.window:
            dropped = entry[1] - self.burst if entry is not None and entry[1] > self.burst else 0
            if len(self._seen) > 10_000:  # many kinds: start over rather than grow
                self._seen.clear()
            self._seen[kind] = [now, 1]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this in the last {self.window:g} s not logged]"
            return True
        entry[1] += 1
        return entry[1] <= self.burst


def start_logging(level: str) -> QueueListener:
    """The root logger (and uvicorn's, which propagate to it) at `level`, to stderr via a queue;
    stop the returned listener to write what is left."""
    records: queue.SimpleQueue = queue.SimpleQueue()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter(FORMAT))
    stderr.addFilter(_uvicorn_name)
    queued = QueueHandler(records)
    queued.addFilter(RepeatLimit())  # before the queue: a flood costs its loggers little
    queued.setFormatter(logging.Formatter("%(message)s"))  # the message (and traceback) only: stderr's adds the rest
    logging.basicConfig(level=level.upper(), handlers=[queued], force=True)
    listener = QueueListener(records, stderr)
    listener.start()
    return listener
