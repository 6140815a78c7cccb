"""A flood of one log message is cut to a burst per window, then summarised."""

from __future__ import annotations

import logging

from vlmserve.logging import RepeatLimit


def _record(msg: str, created: float, name: str = "uvicorn") -> logging.LogRecord:
    record = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), None)
    record.created = created
    return record


def test_one_kind_of_message_is_cut_to_its_burst_and_the_drop_is_reported():
    limit = RepeatLimit(burst=5, window=10.0)
    passed = [limit.filter(_record("accept failed: %s", 100.0 + i * 0.01)) for i in range(50)]
    assert sum(passed) == 5 and passed[:5] == [True] * 5
    other = _record("something else", 100.5)
    assert limit.filter(other)  # another kind has its own budget
    later = _record("accept failed: %s", 111.0)
    assert limit.filter(later)
    assert "45 more like this" in str(later.msg)
    assert limit.filter(_record("accept failed: %s", 111.1)) and "more like this" not in "accept failed: %s"
