"""The table of attention shapes with a cuDNN plan (engine/ops/attention_plans.py): shapes met
without one are queued for idle time, built oldest first, kept within MLX's plan cache."""

from __future__ import annotations

import pytest

from vlmserve.engine.ops.attention_plans import MAX_WANTED, AttentionPlans


def test_a_shape_met_without_a_plan_is_queued_once_and_planned_after_its_build():
    plans, built = AttentionPlans(), []
    assert not plans.planned("a")
    plans.want("a", lambda: built.append("a"))
    plans.want("a", lambda: built.append("a again"))  # met again before idle time: still one build
    plans.want("b", lambda: built.append("b"))
    assert plans.pending() == 2
    plans.build_next()
    assert built == ["a"] and plans.planned("a") and not plans.planned("b") and plans.pending() == 1


def test_calls_inside_a_build_go_to_cudnn_whatever_their_shape():
    plans = AttentionPlans()
    seen = []
    plans.want("a", lambda: seen.append(plans.planned("a") and plans.planned("other")))
    plans.build_next()
    with plans.building():
        assert plans.planned("warm-up shape")
    assert seen == [True] and not plans.planned("other")


def test_a_failed_build_is_not_queued_again_and_its_shape_stays_plan_free():
    plans = AttentionPlans()

    def fails():
        raise RuntimeError("cuDNN has no engine for this graph")

    plans.want("a", fails)
    with pytest.raises(RuntimeError):
        plans.build_next()
    plans.want("a", fails)
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


def test_a_shape_planned_by_a_call_leaves_the_queue_and_the_queue_is_bounded():
    plans = AttentionPlans()
    plans.want("a", lambda: None)
    plans.note_planned("a")
    assert plans.pending() == 0
    for i in range(MAX_WANTED + 5):
        plans.want(i, lambda: None)
    assert plans.pending() == MAX_WANTED


def test_a_shape_met_by_enough_calls_is_due_between_steps_at_most_once_an_interval(monkeypatch):
    """Each call counts a shape once, however many layers meet it; a due build is the oldest hot
    shape, and the next waits HOT_INTERVAL_S."""
    from vlmserve.engine.ops import attention_plans

    now = [100.0]
    monkeypatch.setattr(attention_plans, "_clock", lambda: now[0])
    plans, built = AttentionPlans(), []
    for _ in range(attention_plans.HOT_CALLS - 1):
        plans.new_call()
        for _layer in range(4):
            plans.want("cold", lambda: built.append("cold"))
            plans.want("warm", lambda: built.append("warm"))
    assert not plans.hot()
    for _ in range(attention_plans.HOT_CALLS):
        plans.new_call()
        plans.want("late", lambda: built.append("late"))
    plans.new_call()
    plans.want("warm", lambda: built.append("warm"))
    assert plans.hot()
    plans.build_next(hot=True)
    assert built == ["warm"] and plans.planned("warm")
    assert not plans.hot()  # "late" is hot too, but the interval has not passed
    now[0] += attention_plans.HOT_INTERVAL_S
    assert plans.hot()
    plans.build_next(hot=True)
    assert built == ["warm", "late"] and not plans.hot() and plans.pending() == 1  # "cold" waits for idle time
