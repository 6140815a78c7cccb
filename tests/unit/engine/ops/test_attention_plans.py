"""The table of attention shapes with a cuDNN plan (engine/ops/attention_plans.py): shapes met
without one are queued for idle time, built oldest first, or between steps once they have lost
a plan's build to the plan-free kernel; kept within MLX's plan cache."""

from __future__ import annotations

import pytest

from vlmserve.engine.ops.attention_plans import MAX_WANTED, PLAN_BUILD_S, AttentionPlans


def test_a_shape_met_without_a_plan_is_queued_once_and_planned_after_its_build():
    plans, built = AttentionPlans(), []
    assert not plans.planned("a")
    plans.want("a", lambda: built.append("a"), 0.0)
    plans.want("a", lambda: built.append("a again"), 0.0)  # met again before idle time: still one build
    plans.want("b", lambda: built.append("b"), 0.0)
    assert plans.pending() == 2
    plans.build_next()
    assert built == ["a"] and plans.planned("a") and not plans.planned("b") and plans.pending() == 1


def test_calls_inside_a_build_go_to_cudnn_whatever_their_shape():
    plans = AttentionPlans()
    seen = []
    plans.want("a", lambda: seen.append(plans.planned("a") and plans.planned("other")), 0.0)
    plans.build_next()
    with plans.building():
        assert plans.planned("warm-up shape")
    assert seen == [True] and not plans.planned("other")


def test_a_failed_build_is_not_queued_again_and_its_shape_stays_plan_free():
    plans = AttentionPlans()

    def fails():
        raise RuntimeError("cuDNN has no engine for this graph")

    plans.want("a", fails, 0.0)
    with pytest.raises(RuntimeError):
        plans.build_next()
    plans.want("a", fails, 0.0)
    assert plans.pending() == 0 and not plans.planned("a")
    with plans.building():
        assert not plans.planned("a")  # warm-up too leaves it to the plan-free kernel


def test_planned_shapes_are_kept_within_half_of_mlx_cache_least_recently_used_first(monkeypatch):
    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "6")
    plans = AttentionPlans()
    for key in "abc":
        plans.note_planned(key)
    assert plans.planned("a")  # used: now the most recent
    plans.note_planned("d")
    assert [plans.planned(k) for k in "abcd"] == [True, False, True, True]


def test_a_shape_planned_by_a_call_leaves_the_queue_and_the_queue_is_bounded_keeping_what_lost_most():
    plans = AttentionPlans()
    plans.want("a", lambda: None, 0.0)
    plans.note_planned("a")
    assert plans.pending() == 0
    built = []
    plans.want("recurring", lambda: built.append("recurring"), 1.0)
    for i in range(MAX_WANTED + 5):  # one-off shapes, each losing little
        plans.want(i, lambda: None, 0.001 * (i + 1))
    assert plans.pending() == MAX_WANTED
    plans.want("least", lambda: None, 0.0)  # lost less than every queued shape: not queued
    assert plans.pending() == MAX_WANTED
    plans.build_next()  # the one that lost most, and it stayed queued
    assert built == ["recurring"]


def test_a_shape_is_due_between_steps_once_it_has_lost_a_plans_build_at_most_once_an_interval(monkeypatch):
    """Rent or buy: a shape's losses add up over its calls; the due build is the shape that lost
    most, and the next waits HOT_INTERVAL_S; one that lost little waits for idle time."""
    from vlmserve.engine.ops import attention_plans

    now = [100.0]
    monkeypatch.setattr(attention_plans, "_clock", lambda: now[0])
    plans, built = AttentionPlans(), []
    small, large = PLAN_BUILD_S / 100, PLAN_BUILD_S / 2
    for _ in range(3):
        plans.want("small", lambda: built.append("small"), small)
        plans.want("large", lambda: built.append("large"), large)
        plans.want("larger", lambda: built.append("larger"), 2 * large)
    assert plans.hot()
    plans.build_next(hot=True)
    assert built == ["larger"] and plans.planned("larger")
    assert not plans.hot()  # "large" has lost a build too, but the interval has not passed
    now[0] += attention_plans.HOT_INTERVAL_S
    assert plans.hot()
    plans.build_next(hot=True)
    now[0] += attention_plans.HOT_INTERVAL_S
    assert built == ["larger", "large"] and not plans.hot() and plans.pending() == 1  # "small" waits for idle time


def test_a_shape_whose_build_costs_more_is_due_between_steps_only_once_it_lost_that(monkeypatch):
    """`build_s`: a build that runs a whole tower call again is due between steps once the shape
    has lost that much, not a plan's build; one due shape does not make the others due."""
    from vlmserve.engine.ops import attention_plans

    now = [100.0]
    monkeypatch.setattr(attention_plans, "_clock", lambda: now[0])
    plans, built = AttentionPlans(), []
    plans.want("tower", lambda: built.append("tower"), 2 * PLAN_BUILD_S, build_s=5 * PLAN_BUILD_S)
    assert not plans.hot()
    plans.build_next(hot=True)  # nothing due
    assert built == [] and plans.pending() == 1
    plans.want("segment", lambda: built.append("segment"), 2 * PLAN_BUILD_S)
    assert plans.hot()
    plans.build_next(hot=True)
    assert built == ["segment"]
    now[0] += attention_plans.HOT_INTERVAL_S
    plans.want("tower", lambda: None, 3 * PLAN_BUILD_S)  # lost 5 plans' builds now
    assert plans.hot()
    plans.build_next(hot=True)
    assert built == ["segment", "tower"] and plans.pending() == 0


def test_a_build_that_notes_its_own_shapes_plans_only_those_it_met():
    """`notes_itself`: the build marks what it met (note_planned under `building()`); a queued
    shape it did not meet is not planned, and is not queued again (it would fail again). A
    failing build takes every shape queued with it out."""
    plans = AttentionPlans()

    def meets_a_only():
        assert plans.planned("a")
        plans.note_planned("a")

    plans.want("a", meets_a_only, 1.0, notes_itself=True)
    plans.want("b", meets_a_only, 0.5, notes_itself=True)
    plans.want("x", lambda: None, 0.1)  # another build's
    plans.build_next()  # "a" lost most: built, and it met only "a"
    assert plans.planned("a") and not plans.planned("b")
    assert plans.pending() == 1  # "b", queued with the same build, is given up on; "x" stays
    plans.want("b", meets_a_only, 1.0, notes_itself=True)
    assert plans.pending() == 1
    plans.build_next()  # "x"
    plans.want("z", meets_a_only, 1.0, notes_itself=True)
    plans.build_next()  # its build met "a" only: "z" is given up on
    assert not plans.planned("z") and plans.pending() == 0

    def fails():
        raise RuntimeError("no")

    plans.want("c", fails, 1.0, notes_itself=True)
    plans.want("d", fails, 0.5, notes_itself=True)
    plans.want("e", lambda: None, 0.1)
    with pytest.raises(RuntimeError):
        plans.build_next()
    assert plans.pending() == 1  # "d" went with "c"; "e" stays
    plans.want("d", fails, 1.0, notes_itself=True)
    assert plans.pending() == 1
