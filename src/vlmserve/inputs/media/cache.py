"""LRU of decoded images keyed by sha256 of the raw bytes, so a repeated image is decoded once.

Bounded by entry count and by total pixels. Thread-safe: decoding runs outside the lock, and
concurrent requests for the same bytes wait for the one decode already in flight. Failures are
not cached. Cached images are shared between callers: treat them as read-only.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future

from PIL import Image

from vlmserve.inputs.media.decode import decode_image
from vlmserve.inputs.media.errors import image_error
from vlmserve.inputs.media.policy import MediaPolicy


class ImageCache:
    def __init__(self, max_entries: int = 64, max_pixels: int = 200_000_000) -> None:
        self.max_entries = max_entries
        self.max_pixels = max_pixels
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Image.Image] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._pixels = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def total_pixels(self) -> int:
        with self._lock:
            return self._pixels

    def get_or_decode(self, data: bytes, policy: MediaPolicy) -> Image.Image:
        key = hashlib.sha256(data).hexdigest()
        with self._lock:
            img = self._entries.get(key)
            if img is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                pending = self._inflight.get(key)
                owner = pending is None
                if owner:
                    pending = self._inflight[key] = Future()
                    self.misses += 1
                else:
                    self.hits += 1  # joins the decode in flight: not decoded again
        if img is not None:
            # Cached under possibly laxer limits: re-apply this caller's policy.
            if len(data) > policy.max_image_bytes:
                raise image_error(f"image exceeds {policy.max_image_bytes} bytes")
            if img.width * img.height > policy.max_image_pixels:
                raise image_error(f"image exceeds {policy.max_image_pixels} pixels")
            return img
        if not owner:
            return pending.result()  # re-raises the owner's MediaError
        try:
            img = decode_image(data, policy)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._insert(key, img)
        pending.set_result(img)
        return img

    def _insert(self, key: str, img: Image.Image) -> None:
        pixels = img.width * img.height
        if pixels > self.max_pixels or self.max_entries <= 0:
            return  # would evict everything else; just don't cache it
        self._entries[key] = img
        self._pixels += pixels
        while len(self._entries) > self.max_entries or self._pixels > self.max_pixels:
            _, old = self._entries.popitem(last=False)
            self._pixels -= old.width * old.height

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pixels = 0
