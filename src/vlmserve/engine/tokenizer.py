"""The tokenizer as the worker uses it: streaming detokenizers, EOS ids, token text.

mlx_vlm's detokenizers (the ones mlx_vlm.generate uses), so streamed text matches it.
Loaded separately from the CPU pool's processor: HF tokenizers are not safe to share
across threads that change their padding/truncation state.
"""

from __future__ import annotations

import copy
from pathlib import Path

from mlx_vlm.tokenizer_utils import load_tokenizer


class TextCodec:
    def __init__(self, model_path: Path):
        wrapper = load_tokenizer(model_path)
        self.hf = wrapper._tokenizer
        self._detokenizer = wrapper.detokenizer
        eos = self.hf.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()

    def new_detokenizer(self):
        detokenizer = copy.copy(self._detokenizer)
        detokenizer.reset()
        return detokenizer

    def token_text(self, token: int) -> str:
        return self.hf.decode([token])
