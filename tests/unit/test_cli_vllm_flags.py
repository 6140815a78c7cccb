"""vLLM's flags users bring along map onto vlmserve's own."""

from __future__ import annotations

import argparse

import pytest

from vlmserve.cli import add_serve_arguments, config_from_args


def _config(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("value", ["image=3", '{"image": 3}'])
def test_limit_mm_per_prompt_sets_the_image_limit(value):
    assert _config("--limit-mm-per-prompt", value).max_images_per_request == 3


@pytest.mark.parametrize("value", ["video=2", "image=x", '{"image": 1, "audio": 1}', "image=-1"])
def test_limit_mm_per_prompt_refuses_what_it_cannot_honour(value):
    with pytest.raises(SystemExit):
        _config("--limit-mm-per-prompt", value)


def test_chat_template_and_parser_and_domains():
    config = _config(
        "--chat-template", "x.jinja", "--tool-call-parser", "mistral", "--allowed-media-domains", "a.com,b.org"
    )
    assert (config.chat_template, config.tool_call_parser, config.allowed_media_domains) == (
        "x.jinja",
        "mistral",
        ("a.com", "b.org"),
    )
