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
