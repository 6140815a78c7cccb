"""PrefixIndex (engine/runner/prefix_index.py) answers what comparing the prompt with every cached
key answers: the longest shared prefix, a key extending another, the keys a key extends."""

from __future__ import annotations

import random

import pytest

from vlmserve.engine.runner.prefix_index import CHUNK, PrefixIndex


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _sequences(rng: random.Random, count: int) -> list[tuple[int, ...]]:
    """Keys that share prefixes of every length (chunk-aligned or not), as cached prompts do."""
    stems = [tuple(rng.randrange(4) for _ in range(rng.randrange(0, 3 * CHUNK))) for _ in range(4)]
    out = []
    for _ in range(count):
        stem = rng.choice(stems)
        stem = stem[: rng.randrange(len(stem) + 1)]
        out.append(stem + tuple(rng.randrange(-2, 4) for _ in range(rng.randrange(1, 2 * CHUNK))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_index_agrees_with_a_scan_of_every_key_as_keys_come_and_go(seed):
    rng = random.Random(seed)
    index, keys = PrefixIndex(), set()
    for step in range(400):
        if keys and rng.random() < 0.3:
            gone = rng.choice(sorted(keys))
            index.remove(gone)
            keys.discard(gone)
        else:
            key = _sequences(rng, 1)[0]
            if key not in keys:
                index.add(key)
                keys.add(key)
        for query in _sequences(rng, 3) + ([rng.choice(sorted(keys))] if keys else []):
            limit = rng.randrange(len(query) + 1)
            best = max((_common(k, query[:limit]) for k in keys), default=0)
            found = index.longest(query, limit)
            if best == 0:
                assert found is None, (step, query, limit)
            else:
                assert found is not None and found[1] == best, (step, query, limit, found, best)
                assert found[0] in keys and _common(found[0], query[:limit]) == best
            extensions = {k for k in keys if len(k) > len(query) and k[: len(query)] == query}
            ext = index.extension_of(query)
            assert (ext in extensions) if extensions else ext is None
            assert sorted(index.prefixes_of(query)) == sorted(
                k for k in keys if len(k) < len(query) and query[: len(k)] == k
            )


def test_removing_every_key_leaves_an_empty_index():
    rng = random.Random(7)
    index = PrefixIndex()
    keys = list(dict.fromkeys(_sequences(rng, 200)))
    for key in keys:
        index.add(key)
    for key in keys:
        index.remove(key)
    assert index.longest(keys[0], len(keys[0])) is None
    root = index._root
    assert not root.children and not root.tails and not root.through
