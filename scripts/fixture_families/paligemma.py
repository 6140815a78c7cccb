"""PaliGemma 2 (paligemma, text model gemma2): SigLIP tower + linear projector, prefix-LM.

Upstream checkpoints (google/paligemma2-*, mlx-community/paligemma2-*) ship no chat template:
mlx_vlm formats the prompt itself (MessageFormat.PROMPT_WITH_IMAGE_TOKEN: "<image>" * n + the
last user message's text) and PaliGemmaProcessor expands "<image>" to image_seq_length tokens,
puts <bos> after the last one and appends "\n". The template below renders exactly that
(last user message only, images first), so that a chat renders as mlx_vlm would format it.

The text model attends bidirectionally over the whole prompt (use_bidirectional_attention
defaults to True for paligemma in mlx_vlm's config), and lm_head is tied to embed_tokens.
Image: 56 px / patch 14 -> 16 "<image>" tokens per image, whatever the input size.
"""

from __future__ import annotations

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
# PaliGemmaProcessor adds these to the tokenizer if missing; real checkpoints have them in the
# vocabulary (so the processor's add_tokens is a no-op), and so does this one.
EXTRA_TOKENS = [f"<loc{i:0>4}>" for i in range(1024)] + [f"<seg{i:0>3}>" for i in range(128)]

# mlx_vlm's formatting of a paligemma prompt, as a chat template: the last user message only,
# "<image>" per image part, then its text parts.
TEMPLATE = (
    "{%- set ns = namespace(last=none) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
    "{%- set ns.last = message -%}{%- endif -%}{%- endfor -%}"
    "{%- if ns.last is not none -%}"
    "{%- if ns.last['content'] is string -%}{{ ns.last['content'] }}"
    "{%- else -%}"
    "{%- for item in ns.last['content'] -%}{%- if item['type'] == 'image' -%}{{ '<image>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for item in ns.last['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endif -%}"
)


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok, **mf.GEMMA_TOKENIZER_SETTINGS, extra_special_tokens={"image_token": "<image>"}, model_max_length=8192
    )
    fast.add_tokens(EXTRA_TOKENS)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    extra_ids = [fast.convert_tokens_to_ids(t) for t in EXTRA_TOKENS]
    n = len(fast)
    text = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
        "vocab_size": n,
        "num_image_tokens": 16,
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "pad_token_id": ids["<pad>"],
        "image_token_index": ids["<image>"],
        "hidden_size": 64,
        "projection_dim": 64,
        "vocab_size": n,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
            "num_channels": 3,
            "projection_dim": 64,
            "num_image_tokens": 16,
            "layer_norm_eps": 1e-6,
        },
    }
    files = {
        "preprocessor_config.json": {
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "SiglipImageProcessor",
            "image_seq_length": 16,
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "PaliGemmaProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 56, "width": 56},
        },
        "generation_config.json": mf.generation_config(ids["<bos>"], ids["<eos>"], ids["<pad>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=[ids["<eos>"]],
        never_ids=sorted(list(ids.values()) + extra_ids),
    )
