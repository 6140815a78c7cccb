"""A streamed choice's text with tool calls held back: content flows as it comes, and from
where a call may begin the text waits for the end, when the calls are parsed out of it."""

from __future__ import annotations

from vlmserve.models.tool_calls import ToolCall, ToolParser


def settle(text: str, content: str, calls: list[ToolCall], keep) -> tuple[str, list[ToolCall]]:
    """(content, calls) once `keep` has picked the calls to return from those parsed out of
    `text`; where it keeps none of those found, their text is content after all."""
    kept = keep(calls) if calls else []
    return (content, kept) if kept or not calls else (text, [])


class ToolCallStream:
    def __init__(self, parser: ToolParser, keep=lambda calls: calls):
        self.parser = parser
        self.keep = keep  # the calls to return of those found (settle)
        self.pending = ""  # text not sent yet that may still turn out to open a call
        self.held: str | None = None  # from where a call may begin, to the end
        self.decided = False  # markerless formats: the output's first character was seen

    def feed(self, text: str) -> str:
        """The content of `text` that can be sent now."""
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        if not self.decided:
            stripped = self.pending.lstrip()
            if not stripped:
                return ""
            self.decided = True
            if stripped.startswith(self.parser.openers):  # maybe calls without a marker: wait for the end
                self.held, self.pending = self.pending, ""
                return ""
        start = self.parser.start
        if start is None:
            out, self.pending = self.pending, ""
            return out
        at = self.pending.find(start)
        if at >= 0:
            out, self.held, self.pending = self.pending[:at], self.pending[at:], ""
            return out
        # Hold back an ending that may be the first characters of the marker.
        keep = next(
            (k for k in range(min(len(start) - 1, len(self.pending)), 0, -1) if start.startswith(self.pending[-k:])), 0
        )
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls)."""
        if self.held is None:
            out, self.pending = self.pending, ""
            return out, []
        held, self.held = self.held, None
        return settle(held, *self.parser.extract(held), self.keep)
