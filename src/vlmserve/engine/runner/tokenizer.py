"""The tokenizer as the worker uses it: streaming detokenizers, EOS ids, token text.

mlx_vlm's detokenizers (the ones mlx_vlm.generate uses) decide what text a request gets.
For byte-level BPE tokenizers (GPT-2-style vocabularies) the stream is eager: mlx_vlm holds each
word back until the next one starts, which delays a stream's first text by one or more
steps, so ByteLevelStream hands out characters as soon as their bytes are complete, with
the same full text. Loaded separately from the CPU pool's processor: HF tokenizers are not
safe to share across threads that change their padding/truncation state.
"""

from __future__ import annotations

import codecs
import copy
from collections.abc import Callable
from pathlib import Path

from mlx_vlm.tokenizer_utils import BPEStreamingDetokenizer, load_tokenizer


class ByteLevelStream:
    """Per-token text for byte-level BPE: every token's bytes go through one incremental UTF-8
    decoder, so a character is out as soon as its bytes are. The text equals mlx_vlm's
    BPEStreamingDetokenizer's: invalid bytes become U+FFFD and an unfinished character at the
    end is dropped. (mlx_vlm decodes the last word with errors="ignore", so an invalid byte
    inside it is dropped there and U+FFFD here.)"""

    def __init__(self, model: BPEStreamingDetokenizer, fallback: Callable[[int], str], known: dict[int, bytes]):
        self._tokenmap = model.tokenmap
        self._byte_decoder = model._byte_decoder
        self._trim_space = model.trim_space
        self._fallback = fallback  # the HF tokenizer's decode of one id
        self._known = known  # token -> its bytes, shared by the model's streams (built once per token)
        self.reset()

    def reset(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.offset = 0

    def _bytes(self, token: int) -> bytes:
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._token_bytes(token)
        return known

    def _token_bytes(self, token: int) -> bytes:
        # Ids past the tokenizer's vocabulary (models pad their embedding) or added tokens outside
        # the byte alphabet: mlx_vlm's detokenizer raises on those; decode them with the tokenizer.
        try:
            value = self._tokenmap[token]
            if value is not None:
                return bytes(self._byte_decoder[c] for c in value)
        except (IndexError, KeyError):
            pass
        return self._fallback(token).encode()

    def add_token(self, token: int) -> None:
        piece = self._decoder.decode(self._bytes(token))
        if not self.text and self._trim_space and piece.startswith(" "):
            piece = piece[1:]
        self.text += piece

    def finalize(self) -> None:
        self._decoder.reset()  # an unfinished character at the end is dropped, as mlx_vlm does

    @property
    def last_segment(self) -> str:
        """Text since the last call. The decoder never takes back what it emitted, so nothing
        is held (mlx_vlm's streams hold text ending in U+FFFD, which here is final)."""
        segment, self.offset = self.text[self.offset :], len(self.text)
        return segment


class TextCodec:
    def __init__(self, model_path: Path):
        wrapper = load_tokenizer(model_path)
        self.hf = wrapper._tokenizer
        self._detokenizer = wrapper.detokenizer
        self._token_bytes: dict[int, bytes] = {}  # for ByteLevelStream
        eos = self.hf.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()

    def new_detokenizer(self):
        if isinstance(self._detokenizer, BPEStreamingDetokenizer):
            return ByteLevelStream(self._detokenizer, self.token_text, self._token_bytes)
        detokenizer = copy.copy(self._detokenizer)
        detokenizer.reset()
        return detokenizer

    def token_text(self, token: int) -> str:
        return self.hf.decode([token])
