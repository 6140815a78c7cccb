"""Mistral3 (Mistral-Small-3.1/3.2 shape): Pixtral vision tower + patch merger, Mistral text model."""

SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]

# Mistral-Small-3.1's template, trimmed: no default system prompt, no tools.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- else %}{{- raise_exception('Only text and image blocks are supported in message content!') }}"
    "{%- endif %}{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'system' %}"
    "{%- if message['content'] is string %}{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}"
    "{%- endif %}{%- endfor %}"
)


def spec(mf):
    # No BOS post-processor: the template renders {{ bos_token }} itself.
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=8192,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    config = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "image_token_index": ids["[IMG]"],
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "vocab_size": n,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<unk>"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 64,
            "head_dim": 16,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000000.0,
            "max_position_embeddings": 8192,
            "sliding_window": None,
            "vocab_size": n,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_channels": 3,
            "image_size": 112,
            "patch_size": 14,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
        },
    }
    files = {
        "preprocessor_config.json": {
            "crop_size": None,
            "do_center_crop": None,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": mf.CLIP_MEAN,
            "image_processor_type": "PixtralImageProcessor",
            "image_std": mf.CLIP_STD,
            "patch_size": {"height": 14, "width": 14},
            "processor_class": "PixtralProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": 112},
        },
        "processor_config.json": {
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
            "image_token": "[IMG]",
            "patch_size": 14,
            "processor_class": "PixtralProcessor",
            "spatial_merge_size": 2,
        },
        "generation_config.json": mf.generation_config(ids["<s>"], ids["</s>"], ids["<unk>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=[ids["</s>"]],
        never_ids=sorted(ids.values()),
    )
