#!/usr/bin/env python
"""Build deterministic tiny random-weight VLM checkpoints and test images.

Usage
-----
    python scripts/make_fixtures.py                 # rebuild fixtures/ (byte-identical)
    python scripts/make_fixtures.py --out DIR       # same small set into DIR/{models,images}
    python scripts/make_fixtures.py --only qwen2_vl # subset
    python scripts/make_fixtures.py --preset qwen2-vl-2b --dtype bfloat16 --out DIR
                                                    # Qwen2-VL-2B-shaped random checkpoint (GPU box;
                                                    # never in CI). --layers/--vision-layers shrink it.
    python scripts/make_fixtures.py --only lfm2_vl --text-config '{"hidden_size": 2048}' --dtype bfloat16 --out DIR
                                                    # a family's tiny checkpoint with its text model
                                                    # resized (benchmarks; GPU box, never in CI)

Every checkpoint is loadable with ``mlx_vlm.load(path)`` (and ``mlx_vlm.utils.load_model`` /
``load_processor``).  Files: config.json, model.safetensors (metadata {"format": "mlx"}),
tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json, and
processor_config.json / video_preprocessor_config.json where the family reads them.

Weights are built the way mlx_vlm's loader builds the model (get_model_and_args ->
ModelConfig.from_dict on a deep copy -> update_module_configs -> Model); every >=2-D tensor is
redrawn from N(0, 0.1) with a numpy RNG seeded per tensor name (MLX's default init gives
degenerate, repetitive output); non-constant 1-D tensors (biases, which MLX draws from its global
PRNG) are redrawn from N(0, 0.02); constant ones (norm scales = 1) are kept.
By default the lm_head rows of every special token (EOS ids included) are zeroed; the small
fixtures use untied embeddings, so the input embeddings of those tokens are untouched (with tied
embeddings the input rows would be zeroed too: harmless for EOS, but it erases what the model
"sees" for the token).  The logit of a special token is then exactly 0 while the max over ~500
random logits is positive, so greedy decoding never emits EOS, <|image_pad|>, <image> etc.: it
runs to exactly max_tokens tokens of plain text.  ``--keep-eos`` disables this.

Tokenizers: byte-level BPE trained with ``tokenizers`` on a built-in corpus whose alphabet is
ASCII printable + \\n + \\t (not the full 256-byte alphabet: bytes outside it would decode to
U+FFFD and streamed text would differ from a full decode); unknown bytes map to ``<unk>``.
Training is single-threaded-deterministic (verified by rebuilding twice and comparing sha256).

Image-token counts
------------------
* qwen2_vl / qwen2_5_vl (dynamic): the image is resized by ``smart_resize`` to multiples of
  ``patch_size * merge_size`` (= 28) within [min_pixels, max_pixels]; grid_thw = (1, H/14, W/14)
  patches; the prompt's single ``<|image_pad|>`` expands to ``t*h*w / merge_size**2`` tokens
  = (H/28)*(W/28).  Fixture config: min_pixels 56*56, max_pixels 64*28*28 (<= 64 tokens).
  Fixture images: 64x48 -> 56x56 -> 4 tokens; 100x80 -> 112x84 -> 12; 224x160 -> 224x168 -> 48;
  alpha PNG 40x40 -> 56x56 -> 4; WEBP 72x56 -> 84x56 -> 6; GIF 48x48 -> 56x56 -> 4.
* llava (fixed): every image is resized/cropped to image_size (56) and ``<image>`` expands to
  (56/14)**2 + num_additional_image_tokens(1) - 1 (vision_feature_select_strategy "default"
  drops CLS) = 16 tokens, whatever the input size.
* gemma3 (fixed): ``<start_of_image>`` expands to "\n\n<start_of_image>" + 4 x
  ``<image_soft_token>`` (mm_tokens_per_image = image_seq_length = 4: 56/14 = 4x4 patches
  avg-pooled 2x2) + "<end_of_image>\n\n", whatever the input size.

Prompts verified with mlx_vlm.generate (temperature 0, exactly max_tokens tokens)
-----------------------------------------------------------------------------------
    model, processor = mlx_vlm.load("fixtures/models/<name>")
    prompt = mlx_vlm.prompt_utils.apply_chat_template(processor, model.config, "Describe this image.",
                                                      num_images=1)
    mlx_vlm.generate(model, processor, prompt, image=["fixtures/images/small_64x48.png"],
                     max_tokens=32, temperature=0.0)
  qwen2_vl:   '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n'
              'Describe this image.<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n'
              '<|im_start|>assistant\n'        (mlx_vlm puts the image after the text here)
  qwen2_5_vl: same, but the image part comes before the text.
  llava:      'USER: <image>\nDescribe this image. ASSISTANT:'  (tokenizer adds <s>)
              mlx_vlm's LlavaProcessor forwards padding= to the image processor, which
              transformers 5.x rejects: wrap processor.image_processor to drop it.
  gemma3:     '<bos><start_of_turn>user\nDescribe this image.<start_of_image><end_of_turn>\n'
              '<start_of_turn>model\n'         (template adds <bos>; the tokenizer does not)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "fixtures"
SMALL_MODELS = ("qwen2_vl", "llava", "qwen2_5_vl", "gemma3")

# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to and in is it that for on with as was at by this be are from or have not "
    "image picture photo color red green blue yellow black white gray orange purple pink brown "
    "cat dog bird car tree house sky sun cloud water river mountain road street city person man "
    "woman child people table chair book cup window door light dark left right top bottom center "
    "small large big little round square circle line stripe pattern gradient shape background "
    "what describe show see shows there here which where how many much one two three four five "
    "please answer question user assistant system helpful you your I we they he she them "
    "hello world test example sample text token model vision language server batch stream "
    "quick brown fox jumps over lazy dog number value data file format json python code "
    "yes no maybe true false none null zero first second third last next previous very "
)
_SENTENCES = (
    "Describe this image in one sentence.",
    "What is in the picture?",
    "The image shows a red square on a blue background.",
    "There are two cats sitting on a wooden table near the window.",
    "You are a helpful assistant.",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Count the objects: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    '{"role": "user", "content": ["text", "image_url"]}',
    "def main(): return [x * 2 for x in range(10)]",
    "A gradient from left (dark) to right (light); stripes at the top & bottom.",
    "Q: What color is the sky? A: The sky is blue.",
    "Temperature=0.0; top_p=1.0; max_tokens=32 -- greedy decoding #test @home ~ok ^_^ |pipe| `code`",
    "Price: $100 (50% off) <tag> 'quoted' \"double\" a+b=c? 3/4 \\path",
)


def _corpus() -> list[str]:
    words = _WORDS.split()
    lines = list(_SENTENCES)
    rng = np.random.default_rng(1234)
    for _ in range(400):
        n = int(rng.integers(4, 14))
        idx = rng.integers(0, len(words), size=n)
        s = " ".join(words[i] for i in idx)
        lines.append(s.capitalize() + rng.choice([".", "?", "!", ","]))
    # Every printable ASCII char appears, so the alphabet is complete and stable.
    lines.append("".join(chr(c) for c in range(32, 127)))
    lines.append("\t\n")
    return lines


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    full = pre_tokenizers.ByteLevel.alphabet()  # 256 chars, unordered
    # bytes_to_unicode mapping (GPT-2): reproduce to pick the printable subset deterministically
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    b2u = {b: chr(c) for b, c in zip(bs, cs)}
    assert set(b2u.values()) == set(full)
    keep = list(range(32, 127)) + [9, 10]
    return sorted(b2u[b] for b in keep)


def train_bpe(vocab_size: int, special_tokens: list[str], unk: str = "<unk>"):
    """Train a byte-level BPE (tokenizers.Tokenizer); special tokens get ids 0..k-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = _byte_alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _wrap_fast(tok, **kwargs):
    """PreTrainedTokenizerFast around `tok`; left padding and no clean-up unless `kwargs` say so."""
    from transformers import PreTrainedTokenizerFast

    kwargs.setdefault("padding_side", "left")
    kwargs.setdefault("clean_up_tokenization_spaces", False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def generation_config(bos, eos, pad) -> dict:
    """generation_config.json: greedy, with these token ids (`bos` None: no bos_token_id)."""
    gen = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    if bos is not None:
        gen["bos_token_id"] = bos
    return gen


# ---------------------------------------------------------------------------------------------
# Chat templates (realistic, per family)
# ---------------------------------------------------------------------------------------------

QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n    {%- set loop_messages = messages -%}\n'
    "{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# ---------------------------------------------------------------------------------------------
# Family specs
# ---------------------------------------------------------------------------------------------

QWEN_SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


# Shared by the tiny fixtures and the 2B preset.
QWEN_TOKENIZER_SETTINGS = dict(
    unk_token="<unk>",
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    extra_special_tokens={
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    model_max_length=32768,
)


def _qwen_tokenizer(vocab_size=512):
    tok = train_bpe(vocab_size, QWEN_SPECIALS)
    fast = _wrap_fast(tok, **QWEN_TOKENIZER_SETTINGS)
    return fast


def _qwen_preprocessor(min_pixels, max_pixels, processor_class="Qwen2VLProcessor"):
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "max_pixels": max_pixels,
        "merge_size": 2,
        "min_pixels": min_pixels,
        "patch_size": 14,
        "processor_class": processor_class,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": 2,
    }


def _qwen_video_preprocessor(min_pixels, max_pixels, processor_class="Qwen2VLProcessor"):
    d = _qwen_preprocessor(min_pixels, max_pixels, processor_class)
    d.pop("image_processor_type")
    d["video_processor_type"] = "Qwen2VLVideoProcessor"
    return d


def spec_qwen2_vl(model_type="qwen2_vl"):
    tok = _qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    n = len(tok)
    if model_type == "qwen2_vl":
        vision = {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "in_chans": 3,
        }
        arch = "Qwen2VLForConditionalGeneration"
    else:  # qwen2_5_vl
        vision = {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
            "in_chans": 3,
            "hidden_act": "silu",
        }
        arch = "Qwen2_5_VLForConditionalGeneration"
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "vocab_size": n,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "vision_config": vision,
    }
    min_px, max_px = 56 * 56, 64 * 28 * 28
    pcls = "Qwen2VLProcessor" if model_type == "qwen2_vl" else "Qwen2_5_VLProcessor"
    files = {
        "preprocessor_config.json": _qwen_preprocessor(min_px, max_px, pcls),
        "video_preprocessor_config.json": _qwen_video_preprocessor(min_px, max_px, pcls),
    }
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    files["generation_config.json"] = generation_config(ids["<|endoftext|>"], eos, ids["<|endoftext|>"])
    return dict(
        config=config,
        tokenizer=tok,
        template=QWEN2_VL_TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )


LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]


def llava_tokenizer(specials, model_max_length):
    """Llama-style tokenizer that prepends <s> itself, with an ``<image>`` token (llava, llava_next)."""
    from tokenizers import processors

    tok = train_bpe(512, specials)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return _wrap_fast(
        tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=model_max_length,
    )


def clip_vision_config(vocab_size, image_size=56) -> dict:
    """The tiny CLIP vision tower (llava, llava_next)."""
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 14,
        "projection_dim": 64,
        "num_channels": 3,
        "layer_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "hidden_act": "quick_gelu",
    }


def spec_llava():
    fast = llava_tokenizer(LLAVA_SPECIALS, model_max_length=4096)
    ids = {t: fast.convert_tokens_to_ids(t) for t in LLAVA_SPECIALS}
    n = len(fast)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": ids["<image>"],
        "image_seq_length": 16,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": n,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["</s>"],
        "bos_token_id": ids["<s>"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "vocab_size": n,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        "vision_config": clip_vision_config(n),
    }
    files = {
        "preprocessor_config.json": {
            "crop_size": {"height": 56, "width": 56},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": CLIP_MEAN,
            "image_processor_type": "CLIPImageProcessor",
            "image_std": CLIP_STD,
            "processor_class": "LlavaProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": 56},
        },
        "processor_config.json": {
            "image_token": "<image>",
            "num_additional_image_tokens": 1,
            "patch_size": 14,
            "processor_class": "LlavaProcessor",
            "vision_feature_select_strategy": "default",
            "image_seq_length": 16,
        },
        "generation_config.json": generation_config(ids["<s>"], ids["</s>"], ids["<pad>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=LLAVA_TEMPLATE,
        files=files,
        eos_ids=[ids["</s>"]],
        never_ids=sorted(ids.values()),
    )


GEMMA3_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]


# Gemma's named tokens (gemma3; gemma3n and paligemma share them).
GEMMA_TOKENIZER_SETTINGS = dict(unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
GEMMA3_IMAGE_TOKENS = {
    "image_token": "<image_soft_token>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}


def spec_gemma3():
    # No BOS post-processor: the template renders {{ bos_token }} itself (adding it in the
    # tokenizer as well gives two BOS tokens).
    tok = train_bpe(512, GEMMA3_SPECIALS)
    fast = _wrap_fast(
        tok, **GEMMA_TOKENIZER_SETTINGS, extra_special_tokens=dict(GEMMA3_IMAGE_TOKENS), model_max_length=8192
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in GEMMA3_SPECIALS}
    n = len(fast)
    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"],
        "mm_tokens_per_image": 4,
        "vocab_size": n,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": eos,
        "hidden_size": 64,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "rope_global_base_freq": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 512,
            "sliding_window_pattern": 2,
            "max_position_embeddings": 8192,
            "mm_tokens_per_image": 4,
            "vocab_size": n,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "vision_use_head": False,
        },
    }
    files = {
        "preprocessor_config.json": {
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_pan_and_scan": None,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Gemma3ImageProcessor",
            "image_seq_length": 4,
            "image_std": [0.5, 0.5, 0.5],
            "pan_and_scan_max_num_crops": None,
            "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None,
            "processor_class": "Gemma3Processor",
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 56, "width": 56},
        },
        "processor_config.json": {"image_seq_length": 4, "processor_class": "Gemma3Processor"},
        "generation_config.json": generation_config(ids["<bos>"], eos, ids["<pad>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=GEMMA3_TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )


# More families, one module each: scripts/fixture_families/<model_type>.py defines
# `spec(mf)` (mf: this module, for its tokenizer and config helpers) returning the same dict.
FAMILY_DIR = Path(__file__).resolve().parent / "fixture_families"


# Families whose checkpoint cannot be tiny, with why. The suite checks the ones built here only
# when asked (`pytest --big-families`); the others are not built at all.
NOT_TINY = {
    "gemma3n": (
        "mlx-vlm builds its MobileNetV5-300M vision tower from code, not from the config: the "
        "checkpoint is 1.1 GB and one image takes ~40 s through the tower on a 2-core CPU, so CI "
        "leaves it out; `pytest --big-families` checks it"
    ),
    "phi3_v": (
        "not built: mlx-vlm hard-codes a CLIP ViT-L/14-336 vision tower (303M parameters) that "
        "every image crosses at least twice (crops plus a global view); its chat template also wants "
        "string content with numbered image tags, which the server does not send"
    ),
}


def family_names() -> tuple[str, ...]:
    """Every family this script builds: the committed ones first, then the family modules."""
    more = sorted(p.stem for p in FAMILY_DIR.glob("*.py") if not p.stem.startswith("_"))
    return AVAILABLE + tuple(n for n in more if n not in AVAILABLE)


def tiny_family_names(big: bool = False) -> tuple[str, ...]:
    """The families whose checkpoints are tiny (what the tests build); `big`: the others built here too."""
    return tuple(n for n in family_names() if big or n not in NOT_TINY)


def get_spec(name):
    if name == "qwen2_vl":
        return spec_qwen2_vl("qwen2_vl")
    if name == "qwen2_5_vl":
        return spec_qwen2_vl("qwen2_5_vl")
    if name == "llava":
        return spec_llava()
    if name == "gemma3":
        return spec_gemma3()
    return load_family(name).spec(sys.modules[__name__])


def load_family(name):
    """The module scripts/fixture_families/<name>.py (families that build on another load it too)."""
    path = FAMILY_DIR / f"{name}.py"
    if not path.exists():
        raise KeyError(f"no fixture family {name!r}; known: {', '.join(family_names())}")
    import importlib.util

    loader = importlib.util.spec_from_file_location(f"fixture_families.{name}", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def build_model(config: dict):
    """Instantiate the mlx_vlm model exactly as mlx_vlm.utils.load_model does."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = copy.deepcopy(config)
    model_class, _ = get_model_and_args(config=cfg)
    cfg.setdefault("text_config", cfg.pop("llm_config", {}))
    cfg.setdefault("vision_config", {})
    cfg.setdefault("audio_config", {})
    model_config = model_class.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(
        model_config, model_class, cfg, ["text", "vision", "perceiver", "projector", "audio"]
    )
    return model_class, model_class.Model(model_config), model_config


def _sanitize(model_class, model, model_config, params: dict) -> dict:
    from mlx_vlm.utils import sanitize_weights

    w = sanitize_weights(model, dict(params))
    if hasattr(model_class, "VisionModel") and hasattr(model_config, "vision_config"):
        w = sanitize_weights(model_class.VisionModel, w, model_config.vision_config)
    if hasattr(model_class, "LanguageModel") and hasattr(model_config, "text_config"):
        w = sanitize_weights(model_class.LanguageModel, w, model_config.text_config)
    return w


def _check_sanitize(model_class, model, model_config, params: dict):
    """The loader runs sanitize() on the saved weights: it must keep names and shapes."""
    from mlx_vlm.utils import sanitize_weights

    w = dict(params)
    w = sanitize_weights(model, w)
    if hasattr(model_class, "VisionModel") and hasattr(model_config, "vision_config"):
        w = sanitize_weights(model_class.VisionModel, w, model_config.vision_config)
    if hasattr(model_class, "LanguageModel") and hasattr(model_config, "text_config"):
        w = sanitize_weights(model_class.LanguageModel, w, model_config.text_config)
    if set(w) != set(params):
        raise RuntimeError(f"sanitize() changed names: +{sorted(set(w) - set(params))} -{sorted(set(params) - set(w))}")
    for k, v in w.items():
        if tuple(v.shape) != tuple(params[k].shape):
            raise RuntimeError(f"sanitize() changed shape of {k}: {params[k].shape} -> {v.shape}")


def _seed_for(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _is_lm_head_or_embed(name: str) -> bool:
    return name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight")


def make_small_weights(config: dict, eos_ids, zero_eos=True, seed=0, std=0.1):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    model_class, model, model_config = build_model(config)
    params = dict(tree_flatten(model.parameters()))
    _check_sanitize(model_class, model, model_config, params)
    tied = not any(k.endswith("lm_head.weight") for k in params)
    out = {}
    for name in sorted(params):
        p = params[name]
        if p.ndim >= 2:
            rng = np.random.default_rng(_seed_for(name, seed))
            a = rng.normal(0.0, std, size=tuple(p.shape)).astype(np.float32)
            if (
                zero_eos
                and eos_ids
                and (name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight")))
            ):
                a[list(eos_ids)] = 0.0
            out[name] = mx.array(a)
        else:
            a = np.array(p.astype(mx.float32))
            if a.size and not np.all(a == a.flat[0]):
                # MLX initializes biases (and e.g. CLIP's class_embedding) from its global
                # PRNG: redraw them so the file does not depend on that state.
                rng = np.random.default_rng(_seed_for(name, seed))
                a = rng.normal(0.0, 0.02, size=a.shape).astype(np.float32)
            out[name] = mx.array(a)
    # Some families tie lm_head to embed_tokens inside sanitize() (gemma3) even though the
    # module has its own lm_head: detect it and store the tied tensor under both names, with
    # the zeroed rows applied to the embedding.
    lm = [k for k in out if k.endswith("lm_head.weight")]
    emb = [k for k in out if k.endswith("embed_tokens.weight")]
    if lm and emb:
        san = _sanitize(model_class, model, model_config, {lm[0]: out[lm[0]], emb[0]: out[emb[0]]})
        if san.get(lm[0]) is san.get(emb[0]) or (
            lm[0] in san and emb[0] in san and np.array_equal(np.array(san[lm[0]]), np.array(san[emb[0]]))
        ):
            e = np.array(out[emb[0]])
            if zero_eos and eos_ids:
                e[list(eos_ids)] = 0.0
            out[emb[0]] = mx.array(e)
            out[lm[0]] = mx.array(e.copy())
    mx.eval(out)
    return out


# ---------------------------------------------------------------------------------------------
# Writing a checkpoint
# ---------------------------------------------------------------------------------------------


def _dump_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _normalize_json_file(path: Path, drop_keys=()):
    obj = json.loads(path.read_text())
    for k in drop_keys:
        obj.pop(k, None)
    _dump_json(path, obj)


def save_tokenizer(fast, template: str, out: Path):
    fast.chat_template = template
    fast.save_pretrained(str(out))
    # One place for the template: chat_template.jinja (mlx_vlm and transformers both read it).
    tc = out / "tokenizer_config.json"
    if tc.exists():
        _normalize_json_file(tc)
    for extra in ("special_tokens_map.json",):
        p = out / extra
        if p.exists():
            _normalize_json_file(p)
    (out / "chat_template.jinja").write_text(template)


def write_checkpoint(name: str, out_models: Path, zero_eos=True, seed=0, text_config=None, dtype=None):
    """`text_config`: keys that replace the family's text model config (a bigger model for a
    benchmark); `dtype`: the weights' dtype (float32 by default)."""
    import mlx.core as mx

    spec = get_spec(name)
    if text_config:
        hidden = spec["config"]["text_config"].get("hidden_size")
        spec["config"]["text_config"].update(text_config)
        vision = spec["config"].get("vision_config", {})
        if "hidden_size" in text_config and vision.get("out_hidden_size") == hidden:
            vision["out_hidden_size"] = text_config["hidden_size"]  # the tower's output is the text model's input
    if dtype:
        spec["config"]["torch_dtype"] = spec["config"]["text_config"]["torch_dtype"] = dtype
    d = out_models / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    _dump_json(d / "config.json", spec["config"])
    for fname, obj in spec["files"].items():
        _dump_json(d / fname, obj)
    save_tokenizer(spec["tokenizer"], spec["template"], d)
    weights = make_small_weights(spec["config"], spec["never_ids"], zero_eos=zero_eos, seed=seed)
    if dtype:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "mlx"})
    return d


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def _pattern(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = (x / max(w - 1, 1)) * 255
    g = (y / max(h - 1, 1)) * 255
    b = ((np.sin(x / 5.0 + seed) + np.cos(y / 7.0)) * 0.25 + 0.5) * 255
    img = np.stack([r, g, b], -1)
    # a few deterministic rectangles
    for _ in range(3):
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        x1, y1 = x0 + int(rng.integers(4, w // 2)), y0 + int(rng.integers(4, h // 2))
        img[y0:y1, x0:x1] = rng.integers(0, 256, size=3)
    return np.clip(img, 0, 255).astype(np.uint8)


IMAGES = {
    # name: (w, h)
    "small_64x48.png": (64, 48),
    "photo_100x80.jpg": (100, 80),
    "alpha_40x40.png": (40, 40),
    "large_224x160.jpg": (224, 160),
    "pattern_72x56.webp": (72, 56),
    "anim_48x48.gif": (48, 48),
}


def write_images(out_images: Path):
    from PIL import Image

    out_images.mkdir(parents=True, exist_ok=True)
    for i, (fname, (w, h)) in enumerate(sorted(IMAGES.items())):
        arr = _pattern(w, h, seed=100 + i)
        path = out_images / fname
        buf = io.BytesIO()
        if fname.endswith(".png") and fname.startswith("alpha"):
            yy, xx = np.mgrid[0:h, 0:w]
            alpha = ((xx + yy) * 255 // (w + h - 2)).astype(np.uint8)
            Image.fromarray(np.dstack([arr, alpha]), "RGBA").save(buf, format="PNG", optimize=False)
        elif fname.endswith(".png"):
            Image.fromarray(arr, "RGB").save(buf, format="PNG", optimize=False)
        elif fname.endswith(".jpg"):
            Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=85)
        elif fname.endswith(".webp"):
            Image.fromarray(arr, "RGB").save(buf, format="WEBP", lossless=True)
        elif fname.endswith(".gif"):
            f1 = Image.fromarray(arr, "RGB").quantize(colors=16, dither=Image.Dither.NONE)
            f2 = Image.fromarray(255 - arr, "RGB").quantize(colors=16, dither=Image.Dither.NONE)
            f1.save(buf, format="GIF", save_all=True, append_images=[f2], duration=100, loop=0)
        path.write_bytes(buf.getvalue())


# ---------------------------------------------------------------------------------------------
# Big preset: Qwen2-VL-2B-Instruct shapes, random weights (GPU machine only)
# ---------------------------------------------------------------------------------------------

QWEN2_VL_2B_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}


def _big_qwen_tokenizer(vocab_size: int):
    """Small trained BPE padded with filler tokens (" ~N") so that len(tokenizer) == vocab_size and
    the special tokens sit at Qwen2's real ids.  Fillers are never produced by merges."""
    from tokenizers import Tokenizer

    base = train_bpe(1024, ["<unk>"])
    tj = json.loads(base.to_str())
    vocab = tj["model"]["vocab"]  # token -> id, ids 0..n-1
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    specials = QWEN2_VL_2B_SPECIAL_IDS
    taken = set(specials.values())
    new_vocab = {}
    nid = 0
    for tokstr, _ in by_id:
        while nid in taken:
            nid += 1
        new_vocab[tokstr] = nid
        nid += 1
    free = [i for i in range(vocab_size) if i not in taken and i not in set(new_vocab.values())]
    for filler, i in enumerate(free):
        # A leading "Ġ" (byte-level space) so streaming detokenizers flush every filler token
        # at once, as they do real words; otherwise a benchmark sees all text at the end.
        name = f"\u0120~{filler}"
        assert name not in new_vocab
        new_vocab[name] = i
    for t, i in specials.items():
        new_vocab[t] = i
    tj["model"]["vocab"] = new_vocab
    tj["added_tokens"] = [
        {
            "id": new_vocab["<unk>"],
            "content": "<unk>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ] + [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in sorted(specials.items(), key=lambda kv: kv[1])
    ]
    tok = Tokenizer.from_str(json.dumps(tj))
    fast = _wrap_fast(tok, **QWEN_TOKENIZER_SETTINGS)
    assert len(fast) >= vocab_size, (len(fast), vocab_size)
    return fast


def build_qwen2_vl_2b(
    out: Path, dtype_name="bfloat16", layers=None, vision_layers=None, seed=0, zero_eos=True, std=0.02
):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    vocab = 151936
    ids = QWEN2_VL_2B_SPECIAL_IDS
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": layers or 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        "vocab_size": vocab,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "torch_dtype": dtype_name,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 28,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": vision_layers or 32,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "hidden_act": "quick_gelu",
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_channels": 3,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    dtype = getattr(mx, dtype_name)
    out.mkdir(parents=True, exist_ok=True)
    tok = _big_qwen_tokenizer(vocab)
    _dump_json(out / "config.json", config)
    min_px, max_px = 56 * 56, 1280 * 28 * 28
    _dump_json(out / "preprocessor_config.json", _qwen_preprocessor(min_px, max_px))
    _dump_json(out / "video_preprocessor_config.json", _qwen_video_preprocessor(min_px, max_px))
    _dump_json(
        out / "generation_config.json",
        generation_config(ids["<|endoftext|>"], [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"]),
    )
    save_tokenizer(tok, QWEN2_VL_TEMPLATE, out)

    model_class, model, model_config = build_model(config)
    params = dict(tree_flatten(model.parameters()))  # lazy: nothing is materialized here
    _check_sanitize(model_class, model, model_config, params)
    tied = not any(k.endswith("lm_head.weight") for k in params)
    key = mx.random.key(seed)
    weights = {}
    for i, name in enumerate(sorted(params)):
        p = params[name]
        if p.ndim >= 2:
            k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.key(seed * 100003 + i)
            a = (mx.random.normal(p.shape, dtype=dtype, key=k) * std).astype(dtype)
            if zero_eos and (name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight"))):
                # EOS rows, plus placeholder rows whose input embeddings are always replaced
                # by vision features (so zeroing them is harmless even though they are tied).
                zero = ["<|im_end|>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"]
                rows = mx.array([ids[t] for t in zero])
                a[rows] = mx.zeros((len(zero), a.shape[1]), dtype=dtype)
            weights[name] = a
        else:
            weights[name] = p.astype(dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


QUANTIZED_SUFFIX = "-4bit"


def write_quantized(src: Path, dst: Path) -> Path:
    """`src` converted as mlx-community publishes 4-bit models: mlx-vlm's own convert, affine
    4-bit weights in groups of 64, bfloat16 scales and unquantized parameters."""
    from mlx_vlm import convert

    if dst.exists():
        shutil.rmtree(dst)
    convert(str(src), str(dst), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
    return dst


def build_small(out: Path, names, zero_eos=True, seed=0, images=True, quantized=False, text_config=None, dtype=None):
    out_models = out / "models"
    out_models.mkdir(parents=True, exist_ok=True)
    built = []
    for name in names:
        built.append(write_checkpoint(name, out_models, zero_eos, seed, text_config, dtype))
        if quantized:
            built.append(write_quantized(built[-1], out_models / f"{name}{QUANTIZED_SUFFIX}"))
    if images:
        write_images(out / "images")
    return built


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="families to build (default: the committed set)")
    ap.add_argument("--list", action="store_true", help="print every family this script builds and exit")
    ap.add_argument("--quantized", action="store_true", help="also write NAME-4bit (4-bit, bfloat16 scales)")
    ap.add_argument("--no-images", action="store_true")
    ap.add_argument("--keep-eos", action="store_true", help="do not zero the EOS lm_head rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=["qwen2-vl-2b"], default=None)
    ap.add_argument("--dtype", default=None, help="the weights' dtype (preset: bfloat16; families: float32)")
    ap.add_argument("--text-config", type=json.loads, default=None, help="JSON keys replacing a family's text config")
    ap.add_argument("--layers", type=int, default=None, help="override text layers (preset)")
    ap.add_argument("--vision-layers", type=int, default=None, help="override vision depth (preset)")
    args = ap.parse_args(argv)

    if args.preset == "qwen2-vl-2b":
        if args.out is None:
            ap.error("--preset needs --out DIR")
        build_qwen2_vl_2b(
            args.out,
            args.dtype or "bfloat16",
            args.layers,
            args.vision_layers,
            seed=args.seed,
            zero_eos=not args.keep_eos,
        )
        print(f"wrote {args.out}")
        return 0

    if args.list:
        print("\n".join(family_names()))
        return 0
    out = args.out or DEFAULT_OUT
    names = args.only if args.only else list(AVAILABLE)
    built = build_small(
        out,
        names,
        zero_eos=not args.keep_eos,
        seed=args.seed,
        images=not args.no_images,
        quantized=args.quantized,
        text_config=args.text_config,
        dtype=args.dtype,
    )
    for d in built:
        print(f"wrote {d}")
    return 0


AVAILABLE = ("qwen2_vl", "llava", "qwen2_5_vl", "gemma3")

if __name__ == "__main__":
    sys.exit(main())
