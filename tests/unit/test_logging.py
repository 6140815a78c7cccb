"""The server's logging (vlmserve/logging.py): records written by a listener thread."""

from __future__ import annotations

import logging
import threading

import pytest

from vlmserve.logging import start_logging


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_log_records_are_written_by_the_listener_thread(root_logging, capfd):
    writers = []
    emit = logging.StreamHandler.emit
    listener = start_logging("info")
    try:
        listener.handlers[0].emit = lambda record: (
            writers.append(threading.current_thread()),
            emit(listener.handlers[0], record),
        )
        logging.getLogger("vlmserve.test").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/health", "1.1", 200)
        logging.getLogger("vlmserve").debug("below the level")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("vlmserve").exception("it failed")
    finally:
        listener.stop()
    err = capfd.readouterr().err
    assert 'INFO vlmserve.test: 127.0.0.1:1 - "GET /health HTTP/1.1" 200' in err
    assert "below the level" not in err
    assert "ERROR vlmserve: it failed\nTraceback" in err and err.count("ValueError: boom") == 1
    assert writers and threading.current_thread() not in writers
