"""Stop strings across token boundaries, without leaking a partial stop string."""

from __future__ import annotations

import pytest

from vlmserve.engine.runner.text_stream import TextStream


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
        seg = self.text[self.offset :]
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


@pytest.mark.parametrize(
    "pieces,stop,text",
    [
        (["Hello", " wor", "ld", "!", " more"], ["world"], "Hello "),
        (["a", "b", "END", "c"], ["END"], "ab"),
        (["x", "E", "N", "D", "y"], ["END"], "x"),
        (["abc", "de"], ["zz"], "abcde"),
        (["one ", "tw", "o three"], ["two", "three"], "one "),
        (["E", "N", "x"], ["END"], "ENx"),  # a partial stop that never completes is released
    ],
)
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


def test_stop_strings_apply_once_min_tokens_are_out():
    """vLLM's min_tokens: a stop string in the first tokens is text like any other."""
    pieces = ["a", "END", "b", "END", "c"]
    early = TextStream(PieceDetokenizer(pieces), ("END",), min_tokens=2)
    out = [early.add(i) for i in range(4)]
    assert out[:2] == ["a", "END"] and "".join(out) == "aENDb" and early.stopped
    later = TextStream(PieceDetokenizer(pieces), ("END",), min_tokens=0)
    assert later.add(0) == "a" and later.add(1) == "" and later.stopped


# ---- byte-level BPE: text as soon as its characters are complete, same text as mlx_vlm ----------


def _byte_level_detokenizers():
    """mlx_vlm's BPEStreamingDetokenizer and ours over one toy vocabulary whose tokens are
    pieces of byte-level strings (GPT-2's bytes-to-unicode map), split inside multi-byte
    characters on purpose."""
    from mlx_vlm.tokenizer_utils import BPEStreamingDetokenizer

    from vlmserve.engine.runner.tokenizer import ByteLevelStream

    BPEStreamingDetokenizer.make_byte_decoder()
    to_unicode = {b: c for c, b in BPEStreamingDetokenizer._byte_decoder.items()}
    raw = [
        b"He",
        b"llo",
        b" w",
        b"\xc3",
        b"\xb6rld",
        b" \xe4",
        b"\xbd\xa0",
        b"\xe5\xa5\xbd",
        b"!",
        b" \xff",
        b"x",
        b" ok",
        b" \xe4\xbd",
    ]
    vocab = {"".join(to_unicode[b] for b in piece): i for i, piece in enumerate(raw)}

    class Tok:
        pass

    tok = Tok()
    tok.vocab = vocab
    theirs = BPEStreamingDetokenizer(tok)
    return raw, theirs, ByteLevelStream(theirs, lambda token: f"<{token}>", {})


@pytest.mark.parametrize(
    "ids",
    [
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # "Hello wörld 你好!" split inside characters
        [2, 3, 4, 9, 10, 11],  # an invalid byte mid-text
        [0, 1, 11, 12],  # ends inside a character
    ],
)
def test_byte_level_stream_matches_mlx_vlm_text_and_is_never_later(ids):
    raw, theirs, ours = _byte_level_detokenizers()
    theirs.reset()
    ours.reset()
    got, seen_theirs, seen_ours = "", 0, 0
    for t in ids:
        theirs.add_token(t)
        ours.add_token(t)
        got += ours.last_segment
        seen_theirs, seen_ours = len(theirs.text), len(ours.text)
        assert ours.text.startswith(theirs.text)  # never behind mlx_vlm's stream
    theirs.finalize()
    ours.finalize()
    got += ours.last_segment
    assert got == theirs.text == ours.text
    assert seen_ours >= seen_theirs


def test_byte_level_stream_emits_a_complete_first_token_at_once():
    raw, theirs, ours = _byte_level_detokenizers()
    ours.reset()
    ours.add_token(0)
    assert ours.last_segment == "He"  # mlx_vlm's stream holds "He" until the next word starts
    ours.add_token(3)  # half of "ö": nothing yet
    assert ours.last_segment == ""
    ours.add_token(4)
    assert ours.last_segment == "örld"


def test_byte_level_tokenizers_stream_eagerly():
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer

    from support.helpers import MODELS
    from vlmserve.engine.runner.tokenizer import ByteLevelStream, TextCodec

    codec = TextCodec(MODELS / "qwen2_vl")
    assert isinstance(codec.new_detokenizer(), ByteLevelStream)
    codec._detokenizer = NaiveStreamingDetokenizer(codec.hf)  # other kinds keep mlx_vlm's own
    assert isinstance(codec.new_detokenizer(), NaiveStreamingDetokenizer)


def test_byte_level_stream_decodes_unmapped_ids_with_the_tokenizer():
    raw, theirs, ours = _byte_level_detokenizers()
    theirs.tokenmap.append("\u4e00")  # an added token outside the byte alphabet
    ours.reset()
    for token in (0, len(raw), len(raw) + 5):  # mapped, unmappable, past the vocabulary
        ours.add_token(token)
    assert ours.last_segment == f"He<{len(raw)}><{len(raw) + 5}>"


def test_streams_of_one_model_share_each_tokens_bytes_and_keep_their_own_text():
    from support.helpers import MODELS
    from vlmserve.engine.runner.tokenizer import TextCodec

    codec = TextCodec(MODELS / "qwen2_vl")
    ids = codec.hf.encode("Hello wörld, 你好! Hello again.")
    first, second = codec.new_detokenizer(), codec.new_detokenizer()
    for token in ids:
        first.add_token(token)
    assert len(codec._token_bytes) == len(set(ids))  # each token's bytes built once
    for token in ids[:4]:  # the second stream reads bytes the first one built
        second.add_token(token)
    first.finalize()
    second.finalize()
    assert first.text == codec.hf.decode(ids)
    assert second.text == codec.hf.decode(ids[:4])
