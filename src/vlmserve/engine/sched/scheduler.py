"""The scheduler: decides what each engine step does. Plain Python, no MLX.

A step (engine/core.py) asks it, in order: which cancelled requests leave, which waiting
requests are admitted (up to max_num_seqs), which new prompts are embedded together, how the
step's prefill budget is spent (short new prompts share one batched forward, a long prompt
goes one chunk per step, or, alone with no row decoding, as much as the budget allows), and
which upcoming requests' inputs to copy to the device ahead of time. The runner
(engine/runner/) carries the decisions out; every running row then takes one batched decode
step. A request arriving mid-decode starts its prefill on the next step.

KV memory is counted in blocks (KVBudget): a request is admitted only when the blocks its
prompt needs are free (a small reserve left for the running rows to grow into), and while a
preempted row waits to resume, nothing new is admitted before it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.engine.sched.request import EngineRequest, Sequence


@dataclass
class PrefillPlan:
    """How one step spends its prefill budget, oldest request first."""

    singles: list[tuple[Sequence, int]] = field(default_factory=list)  # (row, most tokens to prefill), in order
    # (row, most tokens) of rows any forward may take the next piece of (prompts of plain causal
    # rows past the first chunk or continuing a cached prefix): prefilled together.
    pieces: list[tuple[Sequence, int]] = field(default_factory=list)
    group: list[Sequence] = field(default_factory=list)  # whole prompts prefilled in one left-padded forward
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # rows whose embedding failed


@dataclass
class Cancelled:
    waiting: list[EngineRequest]
    prefilling: list[Sequence]
    running: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)


class PromptTooLong(ValueError):
    """A prompt needs more KV blocks than the whole budget holds."""


TOO_LONG = "context_length_exceeded"  # the OpenAI error code a PromptTooLong is answered with (400)


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int = 32,
        prefill_chunk: int = 512,
        prefill_budget: int | None = None,
        prefill_bucket: int = 0,
        kv_budget: KVBudget | None = None,
        lone_pairs: int | None = None,
    ):
        self.max_num_seqs = max_num_seqs
        # The most query-key pairs (piece x context) of a lone prompt's forward past a chunk
        # (its attention is not fused on every backend); None: the budget alone bounds it.
        self.lone_pairs = lone_pairs
        self.lone_takes_budget = True  # off: a lone prompt goes a chunk a step too (warm-up's shapes)
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget or prefill_chunk  # prompt tokens per step, all requests
        self.prefill_bucket = prefill_bucket  # pad prompt lengths to multiples of this (0: exact shapes)
        self.inbox: deque[EngineRequest] = deque()  # appended from any thread
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []  # rows put aside for KV memory, in arrival order
        self.kv_budget = kv_budget or KVBudget(1 << 30, 32)  # none given: unbounded

    # ---- called from any thread ------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.inbox.append(req)

    # ---- counts ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling) + len(self.preempted)

    @property
    def num_waiting(self) -> int:
        # Read from other threads while take_inbox moves requests from the inbox to the queue:
        # the inbox first, so a request moving meanwhile counts twice, never not at all.
        return len(self.inbox) + len(self.waiting)

    def has_requests(self) -> bool:
        return bool(self.inbox or self.waiting or self.prefilling or self.running or self.preempted)

    # ---- decisions -----------------------------------------------------------------
    def take_inbox(self) -> None:
        """Requests handed over from other threads join the waiting queue, in arrival order."""
        while self.inbox:
            self.waiting.append(self.inbox.popleft())

    def take_cancelled(self) -> Cancelled:
        """Remove cancelled requests from the waiting queue and the prefilling rows; the cancelled
        running rows are only named (they leave the decode batch with `remove_running`)."""
        gone = Cancelled([r for r in self.waiting if r.cancelled], [s for s in self.prefilling if s.req.cancelled], [])
        for req in gone.waiting:
            self.waiting.remove(req)
        for seq in gone.prefilling:
            self.prefilling.remove(seq)
            self._release(seq)
        gone.preempted = [s for s in self.preempted if s.req.cancelled]
        for seq in gone.preempted:
            self.preempted.remove(seq)
            seq.host_kv = None
        gone.running = [s for s in self.running if s.req.cancelled]
        return gone

    def admit(
        self, make_row: Callable[[EngineRequest], Sequence]
    ) -> tuple[list[Sequence], list[tuple[EngineRequest, Exception]]]:
        """Admit waiting requests while rows and the KV blocks of their prompts are free (none
        while a preempted row waits); `make_row` builds a request's row state. Returns (admitted
        rows, [(request, exception)] for requests that cannot run: a row that could not be
        made, or a prompt longer than the whole KV budget)."""
        admitted, failed = [], []
        budget = self.kv_budget
        reserve = budget.total // 100  # room for the running rows' next blocks
        while self.waiting and not self.preempted and self.num_running < self.max_num_seqs:
            req = self.waiting[0]
            need = budget.blocks_for(req.prepared.num_prompt_tokens + 1) + budget.row_blocks
            if need > budget.total:
                self.waiting.popleft()
                too_long = PromptTooLong(f"the prompt needs {need} KV blocks; the budget holds {budget.total}")
                failed.append((req, too_long))
                continue
            if need + reserve > budget.free and self.num_running:
                break  # first come, first served: it waits for blocks
            if not budget.take(need):
                break
            self.waiting.popleft()
            try:  # a request the runner cannot take (e.g. a seed out of range) ends only itself
                seq = make_row(req)
            except Exception as exc:
                budget.give(need)
                failed.append((req, exc))
                continue
            seq.kv_units = need
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted, failed

    def step_tokens(self, remaining: int) -> int:
        """What a prompt with `remaining` tokens to prefill counts against a step's budget."""
        return max(1, min(remaining, self.prefill_chunk))

    def lone_share(self, start: int, remaining: int) -> int:
        """What a lone prompt, with no row decoding, prefills this step: chunks exist so running
        streams keep their pace between a long prompt's pieces, and there are none, so it takes
        the step's budget (fewer forwards: 512 + 75 tokens at 1,081 of context took 21 ms in two
        forwards and 12 ms in one on an H100), its padded length within `lone_pairs` query-key
        pairs, never less than a chunk (or the budget, if smaller)."""
        share = min(remaining, self.prefill_budget)
        if self.lone_pairs:
            share = min(share, int((math.sqrt(start * start + 4 * self.lone_pairs) - start) / 2))
            if share > self.prefill_chunk and not self._pairs_fit(start, share):
                # Padded lengths grow with the share: the longest share whose padded length fits.
                low, high = self.prefill_chunk, share  # low fits (or is the floor), high does not
                while high - low > 1:
                    mid = (low + high) // 2
                    low, high = (mid, high) if self._pairs_fit(start, mid) else (low, mid)
                share = low
        return max(share, min(remaining, self.prefill_chunk, self.prefill_budget))

    def _pairs_fit(self, start: int, share: int) -> bool:
        padded = self.padded_length(share)
        return padded * (start + padded) <= self.lone_pairs

    def padded_length(self, longest: int) -> int:
        """The length a prompt piece forward whose longest piece has `longest` positions pads to:
        a multiple of the prefill bucket; past a chunk (a lone prompt's piece), first a multiple
        of an eighth of the power of two at or above it (640, 768, 896, 1024, 1280, ... with a
        bucket of 64). On CUDA every padded length costs tens of ms the first time it runs, so
        the lengths past a chunk stay few (a handful per doubling, all run once while idle), and
        padding stays under a quarter where the bucket is at most that eighth."""
        bucket = max(1, self.prefill_bucket)
        n = max(1, longest)
        if bucket > 1 and n > self.prefill_chunk:
            step = max(1, (1 << (n - 1).bit_length()) // 8)
            n = -(-n // step) * step
        return -(-n // bucket) * bucket

    def lone_piece_lengths(self, start: int, context_length: int) -> list[int]:
        """Every padded length past a chunk that a lone prompt's piece from `start` can take (with
        exact shapes, none)."""
        if self.prefill_bucket <= 1:
            return []
        longest = min(self.lone_share(start, 1 << 30), context_length - start - 1)
        return sorted({self.padded_length(n) for n in range(self.prefill_chunk + 1, longest + 1)})

    def unembedded_in_budget(self) -> tuple[list[Sequence], int]:
        """The prefilling prompts not yet embedded that the next prefill's budget reaches (in
        order, each counted at most a chunk, embedded ones too), and the budget left after all."""
        budget, todo = self.prefill_budget, []
        for seq in self.prefilling:
            if budget <= 0:
                break
            if not seq.embedded:
                todo.append(seq)
            budget -= self.step_tokens(seq.prefill_end - seq.prefilled)
        return todo, budget

    def plan_prefill(self, embed: Callable[[Sequence], None]) -> PrefillPlan:
        """Spend the step's prefill budget, oldest request first. `embed` embeds a row not yet
        embedded (a prefix-cache hit there advances `prefilled`, so it comes before the row's
        share is counted); a row whose embedding raises is named in `failed`.

        New prompts that fit whole go into one batched forward; any other prompt takes the
        budget left, at most a chunk (a prompt the model attends to as a whole takes all of it,
        however long, once the budget reaches it; a lone one with no row decoding takes
        `lone_share`). A lone new prompt is prefilled on its own (without a prefill bucket:
        exactly mlx_vlm.generate's shapes)."""
        plan = PrefillPlan()
        budget = self.prefill_budget
        lone = self.lone_takes_budget and len(self.prefilling) == 1 and not self.running
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            try:
                embed(seq)
            except Exception as exc:  # one bad request ends only itself
                plan.failed.append((seq, exc))
                continue
            remaining = seq.piece_end - seq.prefilled  # (a prompt with a checkpoint stops there first)
            batchable = seq.prefilled == 0 and seq.num_prompt > 1 and seq.batchable
            if batchable and remaining <= min(budget, self.prefill_chunk):
                plan.group.append(seq)
                budget -= remaining
            else:
                if seq.whole_prompt:
                    share = remaining
                elif lone and seq.batchable:  # plain causal caches: the pieces forward's rows
                    share = self.lone_share(seq.prefilled, remaining)
                else:
                    share = min(budget, self.prefill_chunk)
                (plan.pieces if seq.batchable and not seq.whole_prompt else plan.singles).append((seq, share))
                budget -= min(remaining, share)
        if len(plan.group) == 1 and self.prefill_bucket <= 1:
            plan.singles.append((plan.group.pop(), self.prefill_chunk))
        return plan

    def to_stage(self) -> list[EngineRequest]:
        """The requests the next step will embed (those prefilling, then those it will admit),
        as far as its prefill budget reaches: their inputs can be copied to the device now."""
        self.take_inbox()
        todo, budget = self.unembedded_in_budget()
        upcoming = [s.req for s in todo]
        for req in list(self.waiting)[: max(0, self.max_num_seqs - self.num_running)]:
            if budget <= 0:
                break
            upcoming.append(req)
            budget -= self.step_tokens(req.prepared.num_prompt_tokens - 1)
        return [r for r in upcoming if r.staged_inputs is None and r.prepared.has_pixels and not r.cancelled]

    # ---- state changes the runner reports --------------------------------------------
    def started_decoding(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.prefilling.remove(seq)
            self.running.append(seq)

    def drop_prefilling(self, seq: Sequence) -> None:
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            self._release(seq)

    def drop_preempted(self, seq: Sequence) -> None:
        """A preempted row ends where it is (its KV on the host let go of)."""
        if seq in self.preempted:
            self.preempted.remove(seq)
            self._release(seq)
            seq.host_kv = None

    def remove_running(self, gone: list[Sequence]) -> None:
        for seq in gone:
            if seq in self.running:
                self._release(seq)
        self.running = [s for s in self.running if s not in gone]

    def preempt(self, seq: Sequence) -> None:
        """A running row, or a prefilled one before its join, steps aside (its KV copied out, its
        blocks given back by the runner); it comes back as the budget allows (`resumed`)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.prefilling.remove(seq)
        self._release(seq)
        self.preempted.append(seq)
        self.preempted.sort(key=lambda s: s.req.arrival)
        self.kv_budget.preemptions += 1

    def resumed(self, seq: Sequence) -> None:
        self.preempted.remove(seq)
        self.running.append(seq)

    def preemption_victim(self) -> Sequence | None:
        """The running row to put aside when blocks run out: the one that arrived last."""
        return max(self.running, key=lambda s: s.req.arrival) if self.running else None

    def _release(self, seq: Sequence) -> None:
        self.kv_budget.give(seq.kv_units)
        seq.kv_units = 0

    def clear(self) -> tuple[list[EngineRequest], list[Sequence]]:
        """Empty every queue; returns what was waiting and what was admitted (worker death, shutdown)."""
        self.take_inbox()
        waiting, admitted = list(self.waiting), self.prefilling + self.running + self.preempted
        self.waiting.clear()
        for seq in admitted:
            self._release(seq)
            seq.host_kv = None
        self.prefilling = []
        self.running = []
        self.preempted = []
        return waiting, admitted
