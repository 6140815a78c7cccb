"""Values computed from an object (an image's content hash, its resized pixels), remembered
for as long as the same object comes back.

Decoded images are shared: the image cache hands every request for the same bytes the same
read-only PIL object, so a chat that sends its image again each turn would otherwise hash and
resize it again each turn. Keys are the object's identity plus what else the value depends on;
an entry holds the object itself, so no other object can take its id while it is remembered.
Bounded by entries and by bytes (the objects' and the values'), least recently used out first.
Thread-safe; a value is computed outside the lock (two threads may both compute it once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class ObjectMemo:
    def __init__(self, max_entries: int, max_bytes: int, size: Callable[[Any, Any], int]):
        """`size(obj, value)`: the bytes an entry keeps alive."""
        self.max_entries, self.max_bytes, self._size = max_entries, max_bytes, size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, Hashable], tuple[Any, Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, obj: Any, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The value for (obj, key), computed by `compute()` on a miss."""
        entry_key = (id(obj), key)
        with self._lock:
            entry = self._entries.get(entry_key)
            if entry is not None and entry[0] is obj:
                self._entries.move_to_end(entry_key)
                self.hits += 1
                return entry[1]
            self.misses += 1
        value = compute()
        size = self._size(obj, value)
        if size > self.max_bytes:
            return value
        with self._lock:
            old = self._entries.pop(entry_key, None)
            if old is not None:
                self._bytes -= old[2]
            self._entries[entry_key] = (obj, value, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
