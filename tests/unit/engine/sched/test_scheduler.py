"""The scheduler's decisions (engine/sched/scheduler.py), driven with fake rows: no model, no MLX."""

from __future__ import annotations

import numpy as np
import pytest

from vlmserve.engine.sched.request import EngineRequest, Sequence
from vlmserve.engine.sched.scheduler import Scheduler
from vlmserve.protocol import PreparedRequest, SamplingParams


def request(name: str, prompt_tokens: int, *, images: int = 0) -> EngineRequest:
    inputs = {"pixel_values": np.zeros((4, 3), np.float32)} if images else {}
    prepared = PreparedRequest(prompt_ids=np.arange(prompt_tokens, dtype=np.int32), model_inputs=inputs,
                               num_images=images)  # fmt: skip
    return EngineRequest(name, prepared, SamplingParams(), emit=lambda event: None)


def row(req: EngineRequest) -> Sequence:
    return Sequence(req=req, sampler=None, text=None)


def embedder(calls: list, cached: dict | None = None, fail: set | None = None):
    """A fake runner.embed: records the order, applies prefix-cache hits, raises for some."""

    def embed(seq: Sequence) -> None:
        if seq.embedded:
            return
        calls.append(seq.req.request_id)
        if fail and seq.req.request_id in fail:
            raise ValueError("bad image")
        seq.prompt = object()
        seq.prefilled = seq.cached_tokens = (cached or {}).get(seq.req.request_id, 0)

    return embed


def admitted(sched: Scheduler, *reqs: EngineRequest) -> list[Sequence]:
    for r in reqs:
        sched.add(r)
    sched.take_inbox()
    return sched.admit(row)[0]


def test_admission_is_fifo_and_stops_at_max_num_seqs():
    sched = Scheduler(max_num_seqs=2)
    rows = admitted(sched, request("a", 5), request("b", 5), request("c", 5))
    assert [s.req.request_id for s in rows] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_a_request_whose_row_cannot_be_made_ends_alone():
    sched = Scheduler(max_num_seqs=4)
    for name in ("a", "bad", "c"):
        sched.add(request(name, 5))
    sched.take_inbox()

    def make(req):
        if req.request_id == "bad":
            raise ValueError("seed out of range")
        return row(req)

    rows, failed = sched.admit(make)
    assert [s.req.request_id for s in rows] == ["a", "c"]
    assert [(r.request_id, type(e)) for r, e in failed] == [("bad", ValueError)]


def test_short_new_prompts_share_one_forward_within_the_budget():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100, prefill_bucket=16)
    admitted(sched, request("a", 41), request("b", 41), request("c", 41))
    calls = []
    plan = sched.plan_prefill(embedder(calls))
    # a and b fit whole (40 tokens each); c's 40 no longer fit the 20 left: it takes those 20 as a piece.
    assert [s.req.request_id for s in plan.group] == ["a", "b"]
    assert [(s.req.request_id, n) for s, n in plan.pieces] == [("c", 20)] and plan.singles == []
    assert calls == ["a", "b", "c"]


def test_a_prompt_with_a_checkpoint_stops_there_once():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100, prefill_bucket=16)
    a, b, c = admitted(sched, request("a", 41), request("b", 41), request("c", 41))
    b.checkpoint = 30  # where a next turn's prompt parts from b's (the runner sets it at embedding)
    plan = sched.plan_prefill(embedder([]))
    # b's first piece (30 tokens) goes with the new prompts; c's 40 no longer fit the 30 left
    assert [s.req.request_id for s in plan.group] == ["a", "b"] and b.next_piece(b.prefill_end) == (0, 30)
    assert [(s.req.request_id, n) for s, n in plan.pieces] == [("c", 30)]
    b.prefilled = 30  # the runner ran that piece
    assert b.piece_end == b.prefill_end == 40 and b.next_piece(60) == (30, 40)


def test_a_long_prompt_goes_one_chunk_per_step():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000)
    decoding, _ = admitted(sched, request("decoding", 5), request("long", 300))
    sched.started_decoding([decoding])  # a running stream: its pace is what the chunk keeps
    plan = sched.plan_prefill(embedder([]))
    assert plan.group == [] and [(s.req.request_id, n) for s, n in plan.pieces] == [("long", 64)]


def test_a_lone_prompt_with_nobody_decoding_takes_the_budget_within_its_attention_bound():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000)
    admitted(sched, request("long", 300))
    assert [(s.req.request_id, n) for s, n in sched.plan_prefill(embedder([])).pieces] == [("long", 299)]
    small = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100)
    admitted(small, request("long", 300))
    assert [n for _, n in small.plan_prefill(embedder([])).pieces] == [100]
    # Piece x context within lone_pairs: 128 x 128 from the start, 81 x (120 + 81) past a cached 120.
    bounded = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000, lone_pairs=128 * 128)
    assert bounded.lone_share(0, 299) == 128 and bounded.lone_share(120, 179) == 81
    assert bounded.lone_share(5000, 299) == 64  # never less than a chunk
    assert bounded.lone_share(120, 30) == 30
    tight = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=40, lone_pairs=10)
    assert tight.lone_share(0, 299) == 40  # a budget below the chunk still bounds it
    admitted(bounded, request("hit", 300))
    assert [n for _, n in bounded.plan_prefill(embedder([], cached={"hit": 120})).pieces] == [81]


def test_warm_up_keeps_a_lone_prompt_to_a_chunk_a_step():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000)
    sched.lone_takes_budget = False
    admitted(sched, request("long", 300))
    assert [n for _, n in sched.plan_prefill(embedder([])).pieces] == [64]


def test_pieces_of_several_long_prompts_share_a_step_within_the_budget():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=150)
    admitted(sched, request("x", 300), request("y", 300), request("z", 300))
    plan = sched.plan_prefill(embedder([], cached={"y": 280}))  # y: 19 left before its last token
    assert [(s.req.request_id, n) for s, n in plan.pieces] == [("x", 64), ("y", 64), ("z", 64)]
    assert plan.singles == [] and plan.group == []
    assert sched.unembedded_in_budget()[1] == 150 - 64 - 19 - 64


def test_a_lone_prompt_without_buckets_keeps_its_exact_shape():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000, prefill_bucket=0)
    admitted(sched, request("a", 10))
    plan = sched.plan_prefill(embedder([]))
    assert plan.group == [] and [(s.req.request_id, n) for s, n in plan.singles] == [("a", 64)]
    with_buckets = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=1000, prefill_bucket=16)
    admitted(with_buckets, request("a", 10))
    assert [s.req.request_id for s in with_buckets.plan_prefill(embedder([])).group] == ["a"]


def test_the_budget_ends_the_step_before_later_prompts_are_embedded():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=64, prefill_bucket=16)
    admitted(sched, request("a", 65), request("b", 10))
    calls = []
    plan = sched.plan_prefill(embedder(calls))
    assert calls == ["a"]  # b waits for the next step, unembedded
    assert [s.req.request_id for s in plan.group] == ["a"] and plan.singles == []


def test_a_prefix_cache_hit_is_prefilled_as_a_piece_and_counts_only_what_is_left():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100, prefill_bucket=16)
    admitted(sched, request("hit", 50), request("a", 41), request("b", 41))
    plan = sched.plan_prefill(embedder([], cached={"hit": 45}))
    # 4 tokens left for the hit (a piece: its cache holds a prefix), then a and b fit whole (40 each).
    assert [(s.req.request_id, n) for s, n in plan.pieces] == [("hit", 64)]
    assert [s.req.request_id for s in plan.group] == ["a", "b"]


def test_a_failed_embedding_is_reported_and_the_step_goes_on():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=200, prefill_bucket=16)
    admitted(sched, request("a", 20), request("bad", 20), request("c", 20))
    plan = sched.plan_prefill(embedder([], fail={"bad"}))
    assert [(s.req.request_id, type(e)) for s, e in plan.failed] == [("bad", ValueError)]
    assert [s.req.request_id for s in plan.group] == ["a", "c"]


def test_unembedded_in_budget_counts_each_prompt_at_most_a_chunk():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=90)
    rows = admitted(sched, request("a", 500), request("b", 30), request("c", 30))
    rows[0].prompt = object()  # already embedded: counted, not listed
    todo, left = sched.unembedded_in_budget()
    assert [s.req.request_id for s in todo] == ["b"]  # 64 + 29 spend the 90: c is past the budget
    assert left == 90 - 64 - 29


def test_inputs_are_staged_for_what_the_next_step_reaches_only():
    sched = Scheduler(max_num_seqs=3, prefill_chunk=64, prefill_budget=128)
    admitted(sched, request("text", 30), request("img", 30, images=1))
    for r in (request("next", 30, images=1), request("later", 30, images=1), request("beyond", 30, images=1)):
        sched.add(r)
    # Prefilling: text (29), img (29) leave 70: "next" (admitted next, one free row) fits, then
    # the rows run out; text prompts have nothing to stage.
    assert [r.request_id for r in sched.to_stage()] == ["img", "next"]
    sched.prefilling[1].req.staged_inputs = "copied"
    assert [r.request_id for r in sched.to_stage()] == ["next"]


def test_cancelled_requests_leave_every_queue():
    sched = Scheduler(max_num_seqs=2)
    rows = admitted(sched, request("a", 5), request("b", 5), request("w", 5))
    sched.started_decoding([rows[0]])
    for r in (rows[0].req, rows[1].req, sched.waiting[0]):
        r.cancelled = True
    gone = sched.take_cancelled()
    assert [r.request_id for r in gone.waiting] == ["w"]
    assert [s.req.request_id for s in gone.prefilling] == ["b"]
    assert [s.req.request_id for s in gone.running] == ["a"]  # named; the runner removes its row
    assert not sched.waiting and not sched.prefilling and sched.running == [rows[0]]
    sched.remove_running(gone.running)
    assert not sched.has_requests()


@pytest.mark.parametrize("queued", [0, 3])
def test_clear_hands_back_everything_once(queued):
    sched = Scheduler(max_num_seqs=1)
    admitted(sched, request("a", 5))
    for i in range(queued):
        sched.add(request(f"q{i}", 5))
    waiting, rows = sched.clear()
    assert len(waiting) == queued and [s.req.request_id for s in rows] == ["a"]
    assert not sched.has_requests() and sched.clear() == ([], [])


def test_staging_counts_the_next_chunk_of_a_prompt_already_embedded():
    """A long prompt that is embedded and partly prefilled takes its next chunk of the budget
    first, so a request behind it that the budget does not reach is not staged yet."""
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=64)
    long_row, _ = admitted(sched, request("long", 300, images=1), request("next", 40, images=1))
    long_row.prompt = object()
    sched.add(request("waiting", 40, images=1))
    long_row.prefilled = 128
    assert sched.to_stage() == []  # the long prompt's next chunk (64) is the whole budget
    long_row.prefilled = 299 - 20
    assert [r.request_id for r in sched.to_stage()] == ["next", "waiting"]  # 20 + 39 < 64: both reached


def test_a_prompt_attended_to_as_a_whole_is_never_chunked():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100, prefill_bucket=16)
    rows = admitted(sched, request("prefix-lm", 300), request("next", 20))
    rows[0].whole_prompt = True
    plan = sched.plan_prefill(embedder([]))
    # The whole 299 tokens in one piece, past the chunk and the budget; nothing else this step.
    assert [(s.req.request_id, n) for s, n in plan.singles] == [("prefix-lm", 299)] and plan.group == []


def test_a_prompt_whose_last_position_runs_in_prefill_counts_it():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=64, prefill_budget=100, prefill_bucket=16)
    rows = admitted(sched, request("wide", 30), request("plain", 30))
    rows[0].last_in_prefill, rows[0].batchable = True, False
    plan = sched.plan_prefill(embedder([]))
    # "wide" alone (its first token comes from its prefill), "plain" in the batched forward.
    assert [(s.req.request_id, n) for s, n in plan.singles] == [("wide", 64)]
    assert [s.req.request_id for s in plan.group] == ["plain"]
    assert rows[0].prefill_end == 30 and rows[1].prefill_end == 29
    assert sched.unembedded_in_budget()[1] == 100 - 30 - 29


def test_pieces_pad_to_the_bucket_up_to_a_chunk_and_to_few_lengths_past_it():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=8192, prefill_bucket=64)
    padded = sched.padded_length
    assert [padded(n) for n in (1, 64, 65, 500, 512)] == [64, 64, 128, 512, 512]
    # Past a chunk: an eighth of the power of two at or above the length.
    assert [padded(n) for n in (513, 587, 641, 1024, 1025, 1300, 2049, 5000)] == [
        640,
        640,
        768,
        1024,
        1280,
        1536,
        2560,
        5120,
    ]
    for n in range(513, 8193, 7):  # padding stays under a quarter of the length
        assert n <= padded(n) < 1.25 * n


def test_exact_shapes_pad_nothing_past_a_chunk_either():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=8192, prefill_bucket=0)
    assert sched.padded_length(587) == 587 and sched.lone_piece_lengths(0, 32768) == []


@pytest.mark.parametrize("bucket", [16, 48, 64, 80, 96])
@pytest.mark.parametrize("chunk", [4, 32, 500, 512])
def test_padded_lengths_are_bucket_multiples_that_never_shrink_as_pieces_grow(bucket, chunk):
    sched = Scheduler(max_num_seqs=8, prefill_chunk=chunk, prefill_budget=8192, prefill_bucket=bucket)
    lengths = [sched.padded_length(n) for n in range(1, 9000)]
    assert all(p % bucket == 0 and p >= n for n, p in enumerate(lengths, 1))
    assert all(a <= b for a, b in zip(lengths, lengths[1:]))


def test_lone_piece_lengths_are_every_length_a_lone_piece_past_a_chunk_pads_to():
    sched = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=2048, prefill_bucket=64)
    lengths = sched.lone_piece_lengths(64, 32768)
    assert lengths == [640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    # The context bounds them, and so does the bound on a lone piece's attention pairs, at the
    # padded length (992 positions fit after 64, but not 1024).
    assert sched.lone_piece_lengths(64, 1000) == [640, 768, 896, 1024]
    paired = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=8192, prefill_bucket=64, lone_pairs=1 << 20)
    assert paired.lone_piece_lengths(64, 32768) == [640, 768, 896]
    # An odd bucket: every padded length a lone share can take is listed (and no other).
    odd = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=8192, prefill_bucket=48, lone_pairs=1 << 25)
    listed = odd.lone_piece_lengths(64, 32768)
    taken = {odd.padded_length(odd.lone_share(start, n)) for start in (64, 500, 2000) for n in range(513, 9000, 3)}
    assert {p for p in taken if p > 512} <= set(listed) and all(p % 48 == 0 for p in listed)


@pytest.mark.parametrize("bucket", [16, 48, 64])
def test_a_lone_piece_past_a_chunk_fits_the_pair_bound_at_its_padded_length(bucket):
    pairs = 1 << 20
    sched = Scheduler(max_num_seqs=8, prefill_chunk=512, prefill_budget=8192, prefill_bucket=bucket, lone_pairs=pairs)
    for start in (0, 64, 300, 600, 1000, 1500):
        for remaining in (100, 513, 700, 900, 5000):
            share = sched.lone_share(start, remaining)
            assert min(remaining, 512) <= share <= remaining
            if share > 512:  # past a chunk it pads; padded, it fits, and one more would not
                padded = sched.padded_length(share)
                assert padded * (start + padded) <= pairs
                if share < remaining:
                    bigger = sched.padded_length(share + 1)
                    assert bigger * (start + bigger) > pairs
    if bucket == 64:
        assert sched.lone_share(64, 5000) == 896  # 992 would fit unpadded, but pads to 1024
