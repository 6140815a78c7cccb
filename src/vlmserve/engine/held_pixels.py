"""Pixel arrays the engine process holds already, by image content: a repeated image (every turn
of an image chat sends it again, as do several questions about one picture) crosses the pipe to
the engine process once. A 1024x768 image's arrays are ~2.4 MB; sending them took 2.5-3.5 ms of a
chat's follow-up turn (H100 host).

The serving side and the engine side each keep a `HeldPixels` of the same budget and note each
request with pixels in the same order (the order of the pipe's messages), so the serving side
knows exactly what the engine holds: it leaves a request's pixel arrays out when they are held,
and the engine puts them back before the request goes further. The arrays are the processor's
output for the images alone, so requests with the same images' content hashes take the same ones
(requests without hashes, as with --no-mm-cache, always carry their own).
"""

from __future__ import annotations

from collections import OrderedDict

# The model inputs that hold an image's pixels (the big arrays); the rest always travel.
PIXEL_INPUTS = ("pixel_values", "pixel_bytes")
HELD_BYTES = 256 << 20


class HeldPixels:
    def __init__(self, max_bytes: int = HELD_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, ...], tuple[int, dict]] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def pixels(model_inputs: dict) -> dict:
        return {k: v for k, v in model_inputs.items() if k in PIXEL_INPUTS}

    def note(self, key: tuple[str, ...], pixels: dict, keep: bool = False) -> dict | None:
        """A request with `pixels`, the pixel arrays of images `key`: if those are held, mark them
        used and return them (what this side keeps of them: the arrays on the engine side, which
        `keep`s them, nothing on the serving side); else hold them within the budget, least recently
        used out first, and return None. A request whose pixels were left out notes none, and finds
        them held."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[1]
        size = sum(v.nbytes for v in pixels.values())
        if size <= self.max_bytes:
            self._entries[key] = (size, pixels if keep else {})
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (dropped, _) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return None

    def __len__(self) -> int:
        return len(self._entries)
