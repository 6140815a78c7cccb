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


def start_logging(level: str) -> QueueListener:
    """The root logger (and uvicorn's, which propagate to it) at `level`, to stderr via a queue;
    stop the returned listener to write what is left."""
    records: queue.SimpleQueue = queue.SimpleQueue()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter(FORMAT))
    stderr.addFilter(_uvicorn_name)
    queued = QueueHandler(records)
    queued.setFormatter(logging.Formatter("%(message)s"))  # the message (and traceback) only: stderr's adds the rest
    logging.basicConfig(level=level.upper(), handlers=[queued], force=True)
    listener = QueueListener(records, stderr)
    listener.start()
    return listener
