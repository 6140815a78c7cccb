"""Keys of the multimodal prefix cache: token ids with each image's placeholders replaced by a
marker of its content, where a prompt's images are one run of placeholders each or not."""

from __future__ import annotations

import numpy as np

from vlmserve.engine.runner.prefix_cache import content_keyed

IMG = 9
RED, BLUE = "a1" * 32, "b2" * 32


def ids(*parts) -> np.ndarray:
    return np.array([t for p in parts for t in p], dtype=np.int32)


def test_one_run_per_image_takes_each_images_own_marker():
    key = content_keyed(ids([1, 2], [IMG] * 3, [5], [IMG] * 2, [6]), IMG, (RED, BLUE))
    red, blue = key[2], key[6]
    assert red < 0 and blue < 0 and red != blue
    assert key.tolist() == [1, 2, red, red, red, 5, blue, blue, 6]


def test_a_tiled_image_keys_every_placeholder_by_the_prompts_images_together():
    # one image in three tiles, separator tokens 7 and 8 between them
    tiled = ids([1], [IMG] * 2, [7], [IMG] * 2, [8], [IMG] * 2, [3])
    key = content_keyed(tiled, IMG, (RED,))
    markers = set(key[tiled == IMG].tolist())
    assert len(markers) == 1 and markers.pop() < 0
    assert key[tiled != IMG].tolist() == [1, 7, 8, 3]
    # a later turn sends the same prompt and more: its key starts with this one
    later = ids(tiled, [4, 4, 2])
    assert content_keyed(later, IMG, (RED,))[: len(tiled)].tolist() == key.tolist()
    # other pixels behind the same text, or another image added, match only before the first image
    for hashes in [(BLUE,), (RED, BLUE)]:
        other = content_keyed(ids(tiled, [7], [IMG] * 2) if len(hashes) == 2 else tiled, IMG, hashes)
        assert other[0] == key[0] and other[1] != key[1]


def test_two_images_in_one_run_are_keyed_together_not_refused():
    key = content_keyed(ids([1], [IMG] * 4, [2]), IMG, (RED, BLUE))
    assert key is not None and len(set(key[1:5].tolist())) == 1
    swapped = content_keyed(ids([1], [IMG] * 4, [2]), IMG, (BLUE, RED))
    assert swapped[1] != key[1]  # the images' order is part of the marker


def test_no_placeholder_no_hash_or_no_image_token_gives_no_key():
    assert content_keyed(ids([1, 2, 3]), IMG, (RED,)) is None  # pixels the ids do not show
    assert content_keyed(ids([1, IMG, 3]), IMG, ()) is None
    assert content_keyed(ids([1, IMG, 3]), None, (RED,)) is None
