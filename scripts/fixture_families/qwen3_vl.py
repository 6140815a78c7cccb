"""Qwen3-VL (model_type qwen3_vl): Qwen3 text model with interleaved M-RoPE, a Qwen3-VL vision
tower (16 px patches, 2x2 merge, learned position embeddings) and deepstack: the vision tower's
intermediate features are added to the hidden states of the first LM layers at image positions.

Tiny shapes: text hidden 64 (2 layers, 4 heads / 2 KV heads, head_dim 16), vision hidden 32
(2 blocks, deepstack from both), 16 px patches merged 2x2 -> one image token per 32x32 pixels.
Fixture images: 64x48 -> 64x64 -> 4 tokens; 100x80 -> 96x96 -> 9; 224x160 -> 224x160 -> 35.
Processor: mlx_vlm's torch-free Qwen3VLProcessor (installed for model_type qwen3_vl).
"""

# The special tokens are Qwen2-VL's (mf.QWEN_SPECIALS) and these.
THINK_SPECIALS = ["<think>", "</think>"]

# The real Qwen3-VL Instruct template without tools: no default system prompt, images as
# <|vision_start|><|image_pad|><|vision_end|> where they appear in the content list.
TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}"
    "{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content_item in message.content %}{%- if 'text' in content_item %}"
    "{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MIN_PIXELS, MAX_PIXELS = 64 * 64, 64 * 32 * 32


def specials(mf):
    return mf.QWEN_SPECIALS + THINK_SPECIALS


def tokenizer(mf):
    tok = mf.train_bpe(512, specials(mf))
    return mf._wrap_fast(tok, **{**mf.QWEN_TOKENIZER_SETTINGS, "model_max_length": 262144})


def preprocessor(mf, processor_class):
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "merge_size": 2,
        "patch_size": 16,
        "processor_class": processor_class,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": 2,
    }


def video_preprocessor(mf, processor_class):
    d = preprocessor(mf, processor_class)
    d.pop("image_processor_type")
    d.update({"video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 768})
    return d


def vision_config(model_type, deepstack_visual_indexes):
    """The tiny Qwen3-VL vision tower (qwen3_5 uses it without deepstack)."""
    return {
        "model_type": model_type,
        "deepstack_visual_indexes": deepstack_visual_indexes,
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_position_embeddings": 16,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def spec(mf):
    fast = tokenizer(mf)
    ids = {t: fast.convert_tokens_to_ids(t) for t in specials(mf)}
    n = len(fast)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = {
        "model_type": "qwen3_vl_text",
        "attention_bias": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 262144,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        # head_dim 16 -> 8 frequencies, interleaved over (t, h, w) as [24, 20, 20] is for 128.
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": n,
        "dtype": "float32",
    }
    vision = vision_config("qwen3_vl", deepstack_visual_indexes=[0, 1])
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "vocab_size": n,
        "dtype": "float32",
    }
    pcls = "Qwen3VLProcessor"
    files = {
        "preprocessor_config.json": preprocessor(mf, pcls),
        "video_preprocessor_config.json": video_preprocessor(mf, pcls),
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
