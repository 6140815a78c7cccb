"""ObjectMemo: values per (object, key), kept for the object itself, bounded by entries and bytes."""

from __future__ import annotations

import gc

from vlmserve.object_memo import ObjectMemo


class Thing:
    pass


def test_a_value_is_computed_once_per_object_and_key():
    memo = ObjectMemo(max_entries=8, max_bytes=1000, size=lambda obj, value: 1)
    calls = []
    a, b = Thing(), Thing()

    def compute(tag):
        calls.append(tag)
        return tag

    assert memo.get(a, 1, lambda: compute("a1")) == "a1"
    assert memo.get(a, 1, lambda: compute("again")) == "a1"
    assert memo.get(a, 2, lambda: compute("a2")) == "a2"
    assert memo.get(b, 1, lambda: compute("b1")) == "b1"
    assert calls == ["a1", "a2", "b1"] and (memo.hits, memo.misses) == (1, 3)


def test_an_entry_keeps_its_object_so_no_other_object_takes_its_id():
    memo = ObjectMemo(max_entries=8, max_bytes=1000, size=lambda obj, value: 1)
    memo.get(Thing(), None, lambda: "first")
    gc.collect()
    assert [memo.get(Thing(), None, lambda i=i: f"new {i}") for i in range(3)] == ["new 0", "new 1", "new 2"]


def test_least_recently_used_entries_leave_past_the_bounds():
    memo = ObjectMemo(max_entries=3, max_bytes=25, size=lambda obj, value: value)
    things = [Thing() for _ in range(4)]
    for t in things[:3]:
        memo.get(t, None, lambda: 5)
    assert memo.get(things[0], None, lambda: 99) == 5  # a hit: now the most recent
    memo.get(things[3], None, lambda: 5)  # a fourth entry: things[1], the least recent, leaves
    assert len(memo) == 3
    assert memo.get(things[1], None, lambda: 6) == 6  # recomputed (and things[2] leaves)
    assert memo.get(things[0], None, lambda: 99) == 5
    big = Thing()
    assert memo.get(big, None, lambda: 30) == 30  # larger than the whole budget: not kept
    assert memo.get(big, None, lambda: 31) == 31
    memo.get(Thing(), None, lambda: 20)  # 20 bytes: the least recent leave until the total fits
    assert memo._bytes == 25 and len(memo) == 2
    assert memo.get(things[0], None, lambda: 99) == 5  # the most recent before it stayed
