"""Per-request incremental detokenization with stop strings.

Stop strings may span token boundaries. Text that could still be the start of a stop
string is held back, so a stream never leaks a partial stop string; the stop text itself
is never emitted.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, detokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self._detok = detokenizer
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded but not yet emitted
        self._unchecked = min_tokens  # tokens still to come before stop strings apply (vLLM's min_tokens)
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        self._detok.add_token(token_id)
        if self._unchecked > 0:
            self._unchecked -= 1
            return self._detok.last_segment
        return self._release(self._detok.last_segment, final=False)

    def finish(self) -> str:
        """No more tokens: flush the detokenizer and whatever was held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

    def _release(self, segment: str, *, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._held + segment
        if not self._stop:
            self._held = ""
            return text
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        if final:
            self._held = ""
            return text
        keep = self._partial_stop_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
