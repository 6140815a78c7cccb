"""Stop strings across token boundaries, without leaking a partial stop string."""

from __future__ import annotations

import pytest

from vlmserve.engine.text_stream import TextStream


class PieceDetokenizer:
    """Each token id is an index into a list of text pieces."""

    def __init__(self, pieces):
        self.pieces, self.text, self.offset = pieces, "", 0

    def add_token(self, token):
        self.text += self.pieces[token]

    def finalize(self):
        pass

    @property
    def last_segment(self):
        seg = self.text[self.offset:]
        self.offset = len(self.text)
        return seg


def run(pieces, stop):
    stream = TextStream(PieceDetokenizer(pieces), tuple(stop))
    out = []
    for i in range(len(pieces)):
        out.append(stream.add(i))
        if stream.stopped:
            break
    out.append(stream.finish())
    return out, stream.stopped


@pytest.mark.parametrize("pieces,stop,text", [
    (["Hello", " wor", "ld", "!", " more"], ["world"], "Hello "),
    (["a", "b", "END", "c"], ["END"], "ab"),
    (["x", "E", "N", "D", "y"], ["END"], "x"),
    (["abc", "de"], ["zz"], "abcde"),
    (["one ", "tw", "o three"], ["two", "three"], "one "),
    (["E", "N", "x"], ["END"], "ENx"),  # a partial stop that never completes is released
])
def test_stop_strings(pieces, stop, text):
    out, stopped = run(pieces, stop)
    assert "".join(out) == text
    assert stopped == any(s in "".join(pieces) for s in stop)


def test_partial_stop_is_held_back_while_streaming():
    stream = TextStream(PieceDetokenizer(["Hi ", "wo", "rld"]), ("world",))
    assert stream.add(0) == "Hi "
    assert stream.add(1) == ""  # "wo" may begin "world": held
    assert stream.add(2) == ""
    assert stream.stopped
