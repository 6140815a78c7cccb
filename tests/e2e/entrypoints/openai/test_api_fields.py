"""Request fields and routes the OpenAI API allows that the server used to refuse."""

from __future__ import annotations

import pytest

from support.server import start_server


def _ask(server, **fields):
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    with server.client() as c:
        return c.post("/v1/chat/completions", json=body)


def test_whole_number_floats_are_integers(qwen_server):
    r = _ask(qwen_server, n=2.0, max_tokens=3.0, seed=7.0)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 6


def test_n_may_go_past_eight(qwen_server):
    r = _ask(qwen_server, n=12, max_tokens=1, temperature=1.0)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(12))


def test_n_past_max_waiting_is_a_400_not_a_429_retried_forever():
    server = start_server("qwen2_vl", max_waiting=4)
    try:
        r = _ask(server, n=5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    finally:
        server.stop()


def test_a_system_only_conversation_is_answered_when_the_template_renders_it(qwen_server):
    body = {"model": qwen_server.model_id, "messages": [{"role": "system", "content": "Say hi."}], "max_tokens": 2}
    with qwen_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_system_fingerprint_is_a_string(qwen_server):
    r = _ask(qwen_server)
    assert isinstance(r.json()["system_fingerprint"], str) and r.json()["system_fingerprint"].startswith("fp_")


@pytest.mark.parametrize("suffix", ["", "-by-alias"])
def test_a_model_is_retrieved_by_id(qwen_server, suffix):
    name = qwen_server.model_id if not suffix else sorted(qwen_server.state.model_names)[-1]
    with qwen_server.client() as c:
        r = c.get(f"/v1/models/{name}")
        assert r.status_code == 200, r.text
        assert r.json() == {**r.json(), "id": qwen_server.model_id, "object": "model"}
        missing = c.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_openai_client_retrieves_the_model(qwen_server):
    import openai

    client = openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(qwen_server.model_id).id == qwen_server.model_id


def test_logit_bias_steers_greedy_choices(qwen_server):
    tokenizer = qwen_server.state.preprocessor.tokenizer
    token = 100
    r = _ask(qwen_server, temperature=0, max_tokens=4, logprobs=True, logit_bias={str(token): 100})
    assert r.status_code == 200, r.text
    chosen = [entry["token"] for entry in r.json()["choices"][0]["logprobs"]["content"]]
    assert chosen == [tokenizer.decode([token])] * 4
    plain = _ask(qwen_server, temperature=0, max_tokens=4, logprobs=True)
    first = plain.json()["choices"][0]["logprobs"]["content"][0]["token"]
    banned_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first))[0]
    banned = _ask(qwen_server, temperature=0, max_tokens=4, logprobs=True, logit_bias={str(banned_id): -100})
    assert banned.json()["choices"][0]["logprobs"]["content"][0]["token"] != first


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"5": "1"}, {"-1": 1}, [1]])
def test_bad_logit_bias_is_a_400(qwen_server, bias):
    r = _ask(qwen_server, logit_bias=bias)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_min_tokens_holds_eos_back(qwen_server):
    """With EOS pushed to the top, a request stops at once; with min_tokens it writes that many
    tokens first (vLLM's extension), and repetition_penalty / min_p are taken alongside."""
    eos = qwen_server.state.preprocessor.tokenizer.eos_token_id
    fields = {"temperature": 0, "max_tokens": 8, "logprobs": True, "logit_bias": {str(eos): 100}}
    at_once = _ask(qwen_server, **fields).json()["choices"][0]
    assert at_once["finish_reason"] == "stop" and not at_once["logprobs"]["content"]
    for extra in ({}, {"repetition_penalty": 1.3, "min_p": 0.05}):
        held = _ask(qwen_server, min_tokens=3, **fields, **extra)
        assert held.status_code == 200, held.text
        choice = held.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["content"]) == 3


@pytest.mark.parametrize(
    "fields",
    [{"repetition_penalty": 0}, {"repetition_penalty": 2.5}, {"min_p": 1.5}, {"min_tokens": -1}, {"min_tokens": 3}],
)
def test_bad_sampling_extensions_are_a_400(qwen_server, fields):
    r = _ask(qwen_server, **fields)  # max_tokens 2: min_tokens 3 is past it
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(fields)), r.text


def _prompt_ids(server, text="Hi") -> set[int]:
    processor = server.state.preprocessor.processor
    rendered = processor.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return set(server.state.preprocessor.tokenizer(rendered)["input_ids"])


def test_repetition_penalty_turns_a_repeated_token_away(qwen_server):
    """Token a is pushed 20 up, b 15: greedy repeats a; with a penalty of 2, a seen a falls to
    ~10 and b wins once, then b falls to ~7.5 and a wins from there (neither is in the prompt)."""
    a, b = [t for t in range(300, 512) if t not in _prompt_ids(qwen_server)][:2]
    fields = {"temperature": 0, "max_tokens": 4, "logprobs": True, "logit_bias": {str(a): 20, str(b): 15}}
    tokenizer = qwen_server.state.preprocessor.tokenizer

    def tokens(**extra):
        r = _ask(qwen_server, **fields, **extra)
        assert r.status_code == 200, r.text
        return [entry["token"] for entry in r.json()["choices"][0]["logprobs"]["content"]]

    ta, tb = tokenizer.decode([a]), tokenizer.decode([b])
    assert tokens() == [ta] * 4
    assert tokens(repetition_penalty=2.0) == [ta, tb, ta, ta]


def test_min_p_of_one_keeps_only_the_likeliest_token(qwen_server):
    """At temperature 1.5, min_p 1 leaves only the top token: the greedy answer, every seed."""
    greedy = _ask(qwen_server, temperature=0, max_tokens=6).json()["choices"][0]["message"]["content"]
    for seed in (1, 2):
        r = _ask(qwen_server, temperature=1.5, min_p=1.0, seed=seed, max_tokens=6)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy, r.text


def test_min_tokens_reaches_completions_and_responses(qwen_server):
    eos = qwen_server.state.preprocessor.tokenizer.eos_token_id
    bias = {str(eos): 100}
    with qwen_server.client() as c:
        legacy = c.post(
            "/v1/completions",
            json={"model": qwen_server.model_id, "prompt": "Hi", "max_tokens": 8, "temperature": 0,
                  "logit_bias": bias, "min_tokens": 3, "logprobs": 0},
        )  # fmt: skip
        response = c.post(
            "/v1/responses",
            json={"model": qwen_server.model_id, "input": "Hi", "max_output_tokens": 8, "temperature": 0,
                  "logit_bias": bias, "min_tokens": 3},
        )  # fmt: skip
    assert legacy.status_code == 200 and len(legacy.json()["choices"][0]["logprobs"]["tokens"]) == 3, legacy.text
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] >= 3, response.text


def test_min_tokens_without_a_limit_raises_the_default_and_refuses_a_grammar(qwen_server):
    ok = _ask(qwen_server, max_tokens=None, min_tokens=600, temperature=0, logit_bias={"3": 100}, ignore_eos=False)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 600, ok.text
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        bad = _ask(qwen_server, min_tokens=2, max_tokens=4, response_format=fmt)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens", bad.text
