"""GLM-4.1V (model_type glm4v): GLM-4 text model (sandwich norms, partial M-RoPE over half the
head) with the GLM-4V vision tower (14 px patches, 2x2 merge, bicubic-interpolated learned
position embeddings, patch merger MLP).

Tiny shapes: text hidden 64 (2 layers, 4 heads / 2 KV heads, head_dim 16, rotary on 8 dims),
vision hidden 32 (2 blocks, image_size 56 -> 4x4 learned positions).
Image tokens: smart_resize to multiples of 28 (pixel limits count the 2 temporal frames);
fixture images: 64x48 -> 56x56 -> 4 tokens; 100x80 -> 112x84 -> 12; 224x160 -> 224x168 -> 48.
Processor: mlx_vlm's Glm46VProcessor (installed for model_type glm4v) over transformers'
Glm4vImageProcessor (its PIL backend without torchvision).
"""

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
    # Glm46VProcessor adds these to the tokenizer: present here, they keep their ids < vocab.
    "<|begin_of_box|>",
    "<|end_of_box|>",
]

# GLM-4.1V-Thinking's template, trimmed (no tools, no metadata); system and assistant turns
# also take list content (the real one prints `{{ msg.content }}` there).
TEMPLATE = """[gMASK]<sop>
{%- for msg in messages %}
    {%- if msg.role == 'system' %}
<|system|>{{ '\\n' }}
        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}{%- if item.type == 'text' %}
{{ item.text }}
            {%- endif %}{%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'user' %}
<|user|>{{ '\\n' }}
        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}
                {%- if item.type == 'video' or 'video' in item %}
<|begin_of_video|><|video|><|end_of_video|>
                {%- elif item.type == 'image' or 'image' in item or 'image_url' in item %}
<|begin_of_image|><|image|><|end_of_image|>
                {%- elif item.type == 'text' %}
{{ item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'assistant' %}
<|assistant|>{{ '\\n' }}
        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}{%- if item.type == 'text' %}
{{ item.text }}
            {%- endif %}{%- endfor %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

# smart_resize compares t*h*w with these, t = temporal_patch_size = 2.
MIN_PIXELS, MAX_PIXELS = 2 * 56 * 56, 2 * 64 * 28 * 28


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
        model_max_length=65536,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    text = {
        "model_type": "glm4v_text",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 65536,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": ids["<|endoftext|>"],
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        # head_dim 16 x 0.5 -> 8 rotary dims -> 4 frequencies over (t, h, w), as [8, 12, 12] for 64.
        "rope_scaling": {"mrope_section": [2, 1, 1], "rope_type": "default", "type": "default"},
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": n,
        "dtype": "float32",
    }
    vision = {
        "model_type": "glm4v",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "depth": 2,
        "hidden_act": "silu",
        "hidden_size": 32,
        "image_size": 56,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "rms_norm_eps": 1e-5,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = {
        "architectures": ["Glm4vForConditionalGeneration"],
        "model_type": "glm4v",
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
        "image_token_id": ids["<|image|>"],
        "image_token_index": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "video_token_index": ids["<|video|>"],
        # mlx_vlm's get_rope_index finds images after vision_start_token_id.
        "vision_start_token_id": ids["<|begin_of_image|>"],
        "vision_end_token_id": ids["<|end_of_image|>"],
        "eos_token_id": eos,
        "pad_token_id": ids["<|endoftext|>"],
        "hidden_size": 64,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "vocab_size": n,
        "dtype": "float32",
    }
    files = {
        "preprocessor_config.json": {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": mf.CLIP_MEAN,
            "image_std": mf.CLIP_STD,
            "image_processor_type": "Glm4vImageProcessor",
            "merge_size": 2,
            "patch_size": 14,
            "processor_class": "Glm4vProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
            "temporal_patch_size": 2,
        },
        "generation_config.json": mf.generation_config(None, eos, ids["<|endoftext|>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )
