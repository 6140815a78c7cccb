"""Requests whose prompt and max_tokens fill the context exactly get every token they asked
for, whether or not a decode step was launched ahead of their last one."""

from __future__ import annotations

from support.families import adapter_loader
from support.helpers import event_tokens, on_own_thread, run_until_idle, token_request
from vlmserve.protocol import FinishReason, SamplingParams

CONTEXT = 64


def test_prompt_and_max_tokens_fill_the_context(tmp_path_factory):
    load = adapter_loader("qwen2_vl", "float32", tmp_path_factory)

    def work():
        from vlmserve.engine.core import EngineCore

        model, codec = load()
        model.info.context_length = CONTEXT  # as --max-model-len sets it
        core = EngineCore(model, codec, max_num_seqs=4)
        events = {}
        # one row alone, then rows together: long prompts, a short one, one a token short of the context
        for batch in ((("alone", 40),), (("a", 40), ("b", 20), ("c", CONTEXT - 1))):
            for rid, length in batch:
                sampling = SamplingParams(max_tokens=CONTEXT - length, temperature=0.0, ignore_eos=True)
                request, events[rid] = token_request(rid, list(range(5, 5 + length)), sampling)
                core.add(request)
            run_until_idle(core)
        return {rid: (len(event_tokens(e)), e[-1].finish_reason) for rid, e in events.items()}

    got = on_own_thread(work)
    want = {"alone": 24, "a": 24, "b": 44, "c": 1}
    assert got == {rid: (n, FinishReason.LENGTH) for rid, n in want.items()}
