"""internvl_chat (InternVL2.5 / InternVL3 remote-code checkpoints): InternViT + pixel-shuffle MLP
projector + Qwen2 language model, shaped like OpenGVLab/InternVL3-1B ("llm_config", dynamic 448-px
tiles with a thumbnail), shrunk to 56-px tiles.

Image tokens: each image is cut into 1..max_dynamic_patch tiles of force_image_size (56) px by
its aspect ratio, plus a thumbnail when it has more than one tile; every tile gives
(56/14)**2 * downsample_ratio**2 = 4 ``<IMG_CONTEXT>`` tokens between ``<img>`` and ``</img>``.
Fixture images (max_dynamic_patch 6): 64x48 -> 3x2 tiles + thumbnail = 7 tiles = 28 tokens;
100x80 -> 2x2 + 1 = 5 tiles = 20 tokens; 224x160 -> 3x2 + 1 = 7 tiles = 28 tokens.

mlx_vlm's InternVLChatProcessor ignores the checkpoint's template: it keeps its own built-in one
("User: <image>\\n{text}\\nAssistant:\\n", which reads a text part's ``content`` key, not
``text``); the tokenizer gets the real InternVL (Qwen2 ChatML) template below.
"""

from __future__ import annotations

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
]

# OpenGVLab/InternVL3's tokenizer template (ChatML, string content), extended to list content
# the way the InternVL3 HF-format checkpoints render it (images as "<image>\n").
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are InternVL, a helpful multimodal assistant.<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=8192,
        padding_side="right",
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": n,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "use_sliding_window": False,
        "sliding_window": 8192,
        "max_window_layers": 2,
        "torch_dtype": "float32",
    }
    vision = {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": 56,
        "patch_size": 14,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
        "drop_path_rate": 0.0,
        "qkv_bias": True,
        "qk_normalization": False,
        "norm_type": "layer_norm",
        "hidden_act": "gelu",
        "use_flash_attn": False,
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "downsample_ratio": 0.5,
        "dynamic_image_size": True,
        "force_image_size": 56,
        "max_dynamic_patch": 6,
        "min_dynamic_patch": 1,
        "use_thumbnail": True,
        "ps_version": "v2",
        "select_layer": -1,
        "template": "internvl2_5",
        "image_token_index": ids["<IMG_CONTEXT>"],
        "eos_token_id": eos,
        "vocab_size": n,
        "torch_dtype": "float32",
        "llm_config": text,
        "vision_config": vision,
    }
    files = {
        "processor_config.json": {
            "image_size": 56,
            "patch_size": 14,
            "downsample_ratio": 0.5,
            "num_image_token": 4,
            "processor_class": "InternVLChatProcessor",
        },
        "generation_config.json": mf.generation_config(ids["<|endoftext|>"], eos, ids["<|endoftext|>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )
