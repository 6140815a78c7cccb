"""The generic adapter's probe of how a model reads a prompt's last position."""

from __future__ import annotations

import logging

from support.helpers import MODELS, on_own_thread


class _ScalesIdEmbeddings:
    """A language model that reads a token id's embedding doubled, but a prompt embedding as
    given (the way Gemma-3n scales only the id path)."""

    def __init__(self, language_model):
        self.inner = language_model

    def __call__(self, inputs=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.inner.model.embed_tokens(inputs) * 2
        return self.inner(inputs, inputs_embeds=inputs_embeds, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prompt_path_probe_tells_models_that_read_ids_differently(caplog):
    from vlmserve.models.generic import GenericModel

    def probe():
        model = GenericModel(MODELS / "gemma3")
        plain = model.prompt_path_differs
        model.language_model = _ScalesIdEmbeddings(model.language_model)
        return plain, model._prompt_path_differs()

    caplog.set_level(logging.WARNING, logger="vlmserve.models.generic")
    plain, scaled = on_own_thread(probe)
    assert not caplog.records  # both answers came from the comparison, not from a probe that failed
    assert plain is False  # the same bits both ways: the last position may ride the first decode step
    assert scaled is True  # else the first token would come from another embedding than mlx_vlm's


def test_the_engines_hook_runs_once_between_reading_the_weights_and_the_first_forward(monkeypatch):
    """load_model_adapter's `before_first_forward` (where the engine waits for kernels under way)
    runs once, after the weights are read and the fast paths installed, before the probe runs the model."""
    from vlmserve.models import generic
    from vlmserve.models.registry import load_model_adapter, model_type_of

    calls = []
    probe = generic.GenericModel._prompt_path_differs
    monkeypatch.setattr(
        generic.GenericModel, "_prompt_path_differs", lambda self: calls.append("forward") or probe(self)
    )
    monkeypatch.setattr(generic.GenericModel, "install_fast_paths", lambda self: calls.append("fast paths"))
    path = MODELS / "qwen2_vl"
    on_own_thread(lambda: load_model_adapter(path, model_type_of(path), (), lambda: calls.append("hook")))
    assert calls == ["fast paths", "hook", "forward"]
