"""An image the processor splits into tiles (LFM2-VL: runs of placeholders parted by separator
tokens) is reused by content too: a later turn about it resumes the earlier prompt's KV, and a
hybrid model's state with it, and answers as a server without reuse."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import boxed_image_uri
from support.server import chat_turns, start_server
from vlmserve.entrypoints.openai.chat_request import parse_chat_request

pytestmark = pytest.mark.slow


def _image() -> str:
    return boxed_image_uri((1024, 768), (200, 40, 40), (100, 200, 600, 400), (30, 30, 200))


def _three_turns(server, image: str) -> list[dict]:
    return chat_turns(server, ("What is in the picture?", "What colour is the box?", "And the background?"), image)


def test_later_turns_about_a_tiled_image_reuse_its_prompt_and_answer_as_without(tmp_path_factory):
    model = str(session_checkpoint("lfm2_vl", "float32", tmp_path_factory))
    image = _image()
    reuse = start_server(model, warmup_image_sizes=())
    try:
        body = {
            "model": reuse.model_id,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Hi"}],
                }
            ],
        }
        prepared = reuse.state.preprocessor.prepare_sync(parse_chat_request(body, reuse.config, {reuse.model_id}, 4096))
        is_image = prepared.prompt_ids == reuse.engine.info.image_token_id
        runs = int((is_image & ~np.concatenate([[False], is_image[:-1]])).sum())
        assert prepared.num_images == 1 and runs > 1  # the case under test: one image, several runs
        with_reuse = _three_turns(reuse, image)
    finally:
        reuse.stop()
    strict = start_server(model, warmup_image_sizes=(), mm_cache=False)
    try:
        without = _three_turns(strict, image)
    finally:
        strict.stop()
    text = [r["choices"][0]["message"]["content"] for r in with_reuse]
    assert text == [r["choices"][0]["message"]["content"] for r in without]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in with_reuse]
    assert cached[0] == 0
    for earlier, later in zip(with_reuse, cached[1:]):  # at least the earlier prompt (its last token rode a step)
        assert later >= earlier["usage"]["prompt_tokens"] - 1
