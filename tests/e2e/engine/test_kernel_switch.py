"""Kernels that change under a running engine (compiled ones replacing uncompiled, quantized
matmuls replacing dequantized weights; EngineCore._kernels_replaced) may round differently: the
KV computed before, whether cached or held by rows still in flight, never reaches a later
request through the prefix cache."""

from __future__ import annotations

import pytest

from support.helpers import MODELS, on_own_thread, token_request
from vlmserve.engine.core import EngineCore
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models.registry import load_model_adapter, model_type_of
from vlmserve.protocol import SamplingParams

pytestmark = pytest.mark.slow

PATH = MODELS / "qwen2_vl"


@pytest.mark.parametrize("switch_at_step", [1, 4], ids=["while-prefilling", "while-decoding"])
def test_rows_in_flight_at_a_kernel_switch_keep_their_kv_out_of_the_prefix_cache(switch_at_step):
    def run():
        codec = TextCodec(PATH)
        model = load_model_adapter(PATH, model_type_of(PATH), codec.eos_token_ids)
        core = EngineCore(
            model, codec, max_num_seqs=4, prefill_chunk=16, prefix_cache_tokens=4096, kv_budget=KVBudget(256, 16)
        )

        def serve(name: str, prompt: list[int], switch_at_step: int | None = None) -> int:
            """Serve one greedy request; returns the prefix cache's tokens after it."""
            request, events = token_request(name, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            core.add(request)
            steps = 0
            while core.has_work():
                core.step()
                steps += 1
                if steps == switch_at_step:
                    core._kernels_replaced()
            assert events[-1].finish_reason is not None and not events[-1].finish_reason.failed
            return core.prefix_cache.size_tokens

        kept = serve("before", list(range(100, 140)))
        core.forget_prefixes()
        # 40 prompt tokens in chunks of 16: the row joins the decode batch at step 3.
        kept_across_switch = serve("across", list(range(200, 240)), switch_at_step=switch_at_step)
        return kept, kept_across_switch

    kept, kept_across_switch = on_own_thread(run)
    assert kept > 0  # a row served by one set of kernels leaves its KV for reuse
    assert kept_across_switch == 0
