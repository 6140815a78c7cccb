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


def _ends_compared(index: PrefixIndex, query: tuple[int, ...]) -> list[tuple[int, bool, bool]]:
    """For each trie node a lookup of `query`'s prefixes visits: its depth, whether it holds
    fewer tails than the positions to check there (prefixes_of compares those tails), and
    whether one of them is a proper prefix of `query`."""
    out = []
    for node, start, ends in index._path(query):
        hit = any(start + len(t) in ends and query[start : start + len(t)] == t for t in node.tails)
        out.append((start // CHUNK, len(node.tails) < len(ends), hit))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_prefixes_of_finds_keys_ending_in_any_chunk_at_nodes_with_few_or_many_key_ends(seed):
    """Keys that are prefixes of a few long sequences, some chunks holding every length (a node
    with a tail per position: each position looked up) and some one or two (those tails
    compared), chunk-aligned keys (an empty tail) among them; queries ending inside a chunk or
    on its edge, and equal to a key (not its own prefix)."""
    rng = random.Random(seed)
    bases = [tuple(rng.randrange(3) for _ in range(6 * CHUNK + rng.randrange(CHUNK))) for _ in range(3)]
    bases.append(bases[0][: 2 * CHUNK + 3] + tuple(rng.randrange(3, 6) for _ in range(3 * CHUNK)))  # a branch
    index, keys = PrefixIndex(), set()
    for base in bases:
        for d in range(len(base) // CHUNK + 1):
            dense = rng.random() < 0.4  # a chunk whose every length is a key, else one or two of them
            span = range(d * CHUNK, min((d + 1) * CHUNK, len(base) + 1))
            for n in span if dense else rng.sample(span, min(len(span), rng.choice((1, 2)))):
                if base[:n] not in keys:
                    index.add(base[:n])
                    keys.add(base[:n])
    seen, aligned = set(), set()
    for _ in range(300):
        base = rng.choice(bases)
        query = base[: rng.randrange(len(base) + 1)]
        if rng.random() < 0.3:
            query = query + (rng.randrange(3),)
        want = sorted(k for k in keys if len(k) < len(query) and query[: len(k)] == k)
        assert sorted(index.prefixes_of(query)) == want, query
        assert query not in index.prefixes_of(query)
        seen.update((few, hit) for d, few, hit in _ends_compared(index, query) if d)
        aligned.update(k for k in want if k and len(k) % CHUNK == 0)
    # past the root (the test above covers it) both ways of comparing found keys and found none,
    # and keys of whole chunks were found
    assert seen == {(few, hit) for few in (False, True) for hit in (False, True)}
    assert aligned
