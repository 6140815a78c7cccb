"""ModelRunner._pieces_forwards: prompt pieces go together in order while rows x longest piece x
widest context stays within PIECES_MAX_PAIRS; a row past it alone goes through the single path
(its KV in the block pool too: the single path fills its own cache back from there)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from vlmserve.engine.runner import model_runner
from vlmserve.engine.runner.model_runner import ModelRunner
from vlmserve.engine.sched.request import Sequence


def _row(name: str, prefilled: int, end: int, pool=None, stop: int | None = None):
    row = SimpleNamespace(name=name, prefilled=prefilled, prefill_end=end, piece_end=stop or end, prefill_pool=pool)
    row.next_piece = partial(Sequence.next_piece, row)  # the real method, over these counts
    return row


def test_rows_split_at_the_bound_and_a_wide_row_goes_alone(monkeypatch):
    monkeypatch.setattr(model_runner, "PIECES_MAX_PAIRS", 3 * 100 * 1000)
    rows = [
        (_row("a", 500, 5000), 100),  # 100 x 600
        (_row("b", 800, 5000), 100),  # 100 x 900
        (_row("wide", 3500, 5000), 100),  # 100 x 3600 > the bound alone
        (_row("c", 900, 5000), 100),  # 3 rows x 100 x 1000 = the bound
        (_row("d", 950, 5000), 100),  # a fourth would pass it
        (_row("short", 0, 20), 100),  # only 20 left
    ]
    forwards = ModelRunner._pieces_forwards(rows)
    assert [([r.name for r, _ in f], together) for f, together in forwards] == [
        (["wide"], False),
        (["a", "b", "c"], True),
        (["d", "short"], True),
    ]


def test_a_row_whose_kv_is_in_the_pool_goes_past_the_bound_alone_too(monkeypatch):
    monkeypatch.setattr(model_runner, "PIECES_MAX_PAIRS", 1000)
    rows = [(_row("pooled", 60, 500, pool=object()), 30), (_row("own", 60, 500), 30), (_row("short", 0, 20), 10)]
    forwards = ModelRunner._pieces_forwards(rows)  # 30 positions ending at 90: 2,700 pairs each
    assert [([r.name for r, _ in f], together) for f, together in forwards] == [
        (["pooled"], False),
        (["own"], False),
        (["short"], True),
    ]


def test_short_pieces_beside_long_ones_go_into_a_forward_of_their_own():
    """A pieces forward runs every row at its longest piece: the one-token rests of prompts that
    stopped at their checkpoint would each cost a long row there."""
    rests = [(_row(f"rest{i}", 100, 101), 512) for i in range(3)]
    long = (_row("long", 0, 5000), 512)
    forwards = ModelRunner._pieces_forwards([rests[0], long, *rests[1:]])
    assert [([r.name for r, _ in f], together) for f, together in forwards] == [
        (["long"], True),
        (["rest0", "rest1", "rest2"], True),
    ]
    # one short piece beside a long one pads less than a second long row: they stay together
    assert len(ModelRunner._pieces_forwards([rests[0], long])) == 1
    # a piece that stops at its checkpoint counts to it
    stopping = (_row("stops", 0, 5000, stop=8), 512)
    assert [[r.name for r, _ in f] for f, _ in ModelRunner._pieces_forwards([stopping, long, *rests])] == [
        ["long"],
        ["stops", "rest0", "rest1", "rest2"],
    ]
