"""Qwen3.5 (model_type qwen3_5): a hybrid text model -- Gated DeltaNet linear-attention layers
(conv + recurrent state, mlx_vlm ArraysCache) with a full-attention layer every
`full_attention_interval` layers (gated queries, partial interleaved M-RoPE, KVCache) -- and the
Qwen3-VL vision tower without deepstack.

Tiny shapes: text hidden 64, 2 layers with full_attention_interval 2 (layer 0 linear, layer 1 full
attention: 4 heads / 2 KV heads, head_dim 32, rotary on a quarter of it), linear attention with
2 key heads / 4 value heads of dim 16; vision hidden 32, 2 blocks, 16 px patches merged 2x2.
Fixture images: 64x48 -> 64x64 -> 4 tokens; 100x80 -> 96x96 -> 9; 224x160 -> 224x160 -> 35.
Processor: mlx_vlm's torch-free Qwen3VLProcessor (installed for model_type qwen3_5).
"""

# Qwen3.5's template, trimmed (no tools): list or string content, images in place, and a
# generation prompt that opens a <think> block unless enable_thinking is false.
TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content, do_vision_count) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{%- if do_vision_count %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- if do_vision_count %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item %}{{- item.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = render_content(message.content, true) %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def spec(mf):
    qwen3_vl = mf.load_family("qwen3_vl")  # same tokenizer, vision tower and processors
    fast = qwen3_vl.tokenizer(mf)
    ids = {t: fast.convert_tokens_to_ids(t) for t in qwen3_vl.specials(mf)}
    n = len(fast)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "full_attention_interval": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 262144,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        # head_dim 32 x partial_rotary_factor 0.25 -> 8 rotary dims -> 4 frequencies.
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": n,
        "dtype": "float32",
    }
    vision = qwen3_vl.vision_config("qwen3_5", deepstack_visual_indexes=[])
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        # Explicit: ModelConfig otherwise appends Qwen3.5's real <|im_end|> id (248046).
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "vocab_size": n,
        "dtype": "float32",
    }
    pcls = "Qwen3VLProcessor"
    files = {
        "preprocessor_config.json": qwen3_vl.preprocessor(mf, pcls),
        "video_preprocessor_config.json": qwen3_vl.video_preprocessor(mf, pcls),
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
