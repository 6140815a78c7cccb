"""The KV budget of a padded batch (models whose caches are not paged: mlx_vlm's batch caches
left-pad every row to the longest): each row is counted at the batch's width, so a short row
beside a long one pays for its padding; when that does not fit, the latest arrival steps aside,
and it resumes only once its padding, and the others' to it, fits."""

from __future__ import annotations

from types import SimpleNamespace

from vlmserve.engine.runner.model_runner import ModelRunner
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.engine.sched.request import Sequence
from vlmserve.engine.sched.scheduler import Scheduler


def _runner(total_blocks: int, paged: bool = False) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # only the budget's bookkeeping: no model, no device
    runner.budget = KVBudget(total_blocks, block_size=16, row_blocks=0 if paged else 1)
    runner.sched = Scheduler(max_num_seqs=8, kv_budget=runner.budget)
    runner.batches = SimpleNamespace(paged=paged)
    runner._weights = {}
    runner.preempted, runner.ended = [], []
    runner.batch = SimpleNamespace(grow=lambda: None, resume=lambda seq, host: None)
    runner._preempt = lambda seq: (runner.preempted.append(seq), runner.sched.preempt(seq))
    runner.finish = lambda seq, reason: runner.ended.append((seq, reason))
    runner.remove_rows = runner.sched.remove_running
    return runner


def _row(runner: ModelRunner, arrival: float, cache_len: int) -> Sequence:
    """A running row of `cache_len` positions, counted as a join counts it (its own positions)."""
    req = SimpleNamespace(arrival=arrival, cancelled=False, request_id=str(arrival))
    seq = Sequence(req=req, sampler=None, text=None, cache_len=cache_len)
    seq.kv_units = runner._cost(cache_len + 1, None)
    assert runner.budget.take(seq.kv_units)
    runner.sched.running.append(seq)
    return seq


def test_rows_of_a_padded_batch_are_counted_at_its_width():
    runner = _runner(total_blocks=40)
    long, short = _row(runner, 1.0, 160), _row(runner, 2.0, 10)  # 11 + 1 and 1 + 1 blocks
    assert runner._padded_width() == 160 and runner.budget.used == 14
    assert runner._row_growth(long, 160) == 0 and runner._row_growth(short, 160) == 10  # its padding
    runner._grow_blocks(None)
    assert short.kv_units == long.kv_units == 12 and runner.budget.used == 24 and not runner.preempted
    runner.sched.remove_running([long])  # the long row ends: the batch narrows, the short row gives back
    assert runner._growth() == -10


def test_the_latest_row_steps_aside_when_its_padding_does_not_fit_and_resumes_when_it_does():
    runner = _runner(total_blocks=20)
    long, short = _row(runner, 1.0, 160), _row(runner, 2.0, 10)
    runner._grow_blocks(None)  # 12 + 12 > 20: the short row (the latest) steps aside, not ended
    assert runner.preempted == [short] and not runner.ended and runner.sched.running == [long]
    assert runner.budget.used == 12
    runner.resume_preempted()  # own cost 2 fits, its padding (10 more) does not
    assert runner.sched.preempted == [short]
    long.cache_len = 100  # a narrower batch: own 2 + padding 6 of the 12 free
    runner.sched.running[0].kv_units = runner._cost(101, None)
    runner.budget.used = long.kv_units
    runner.resume_preempted()
    assert runner.sched.running == [long, short] and runner.sched.preempted == []


def test_when_the_long_row_arrived_last_it_steps_aside_and_the_batch_narrows():
    runner = _runner(total_blocks=20)
    short, long = _row(runner, 1.0, 10), _row(runner, 2.0, 160)
    runner._grow_blocks(None)  # the long row (the latest) steps aside: the short one is 2 again
    assert runner.preempted == [long] and runner.sched.running == [short]
    assert short.kv_units == 2 and runner.budget.used == 2 == sum(s.kv_units for s in runner.sched.running)


def test_a_row_longer_than_the_running_ones_resumes_only_with_room_for_their_padding_to_it():
    runner = _runner(total_blocks=20)
    a, b = _row(runner, 1.0, 10), _row(runner, 2.0, 10)  # 2 + 2 blocks
    long = _row(runner, 3.0, 100)  # own 8: 12 in all
    runner._preempt(long)
    assert runner.budget.used == 4
    runner.resume_preempted()  # its 8, and the others' padding to 101 positions: 2 x 6 more > 16 free
    assert runner.sched.preempted == [long]
    runner.sched.remove_running([b])
    runner.resume_preempted()  # 8 + 6 of 18 free
    assert runner.sched.running == [a, long]


def test_paged_rows_are_counted_at_their_own_length():
    runner = _runner(total_blocks=40, paged=True)
    runner._weights = {None: 1}  # (no model to ask for its KV dtype)
    short, long = _row(runner, 1.0, 10), _row(runner, 2.0, 160)
    short.blocks, long.blocks = [1], list(range(2, 12))  # one block for 10 positions, ten for 160
    assert runner._padded_width() == 0
    assert [runner._row_growth(s, runner._padded_width()) for s in (short, long)] == [0, 1]  # no padding


def test_rows_that_arrived_after_a_long_joining_row_step_aside_before_it_joins():
    """A long row joining late (its prompt took longer) beside shorter rows that arrived after
    it: those step aside, latest first, until the padding its join makes fits, while the batch
    is still narrow; earlier rows are never set aside for it."""
    runner = _runner(total_blocks=30)
    early = _row(runner, 0.5, 10)
    later = [_row(runner, 2.0, 10), _row(runner, 3.0, 10)]
    joining = _row(runner, 1.0, 160)  # paid for its own positions (12) at the join
    runner.sched.running.remove(joining)
    runner._make_room_for_padding([joining])  # 3 x 10 more for the others' padding > 30 - 18 free
    assert runner.preempted == [later[1], later[0]] and runner.sched.running == [early]
    assert runner.budget.used == 14 and runner._growth() + runner._row_growth(joining, 160) <= runner.budget.free


def test_a_joining_row_that_arrived_last_is_left_to_the_next_steps_growth():
    runner = _runner(total_blocks=16)
    first = _row(runner, 1.0, 10)
    joining = _row(runner, 2.0, 160)
    runner.sched.running.remove(joining)
    runner._make_room_for_padding([joining])  # nothing arrived after it: nothing set aside now
    assert not runner.preempted and runner.sched.running == [first]
