"""Kimi-VL (Kimi-VL-A3B shape): MoonViT vision tower, DeepSeek-V3 text model (MLA + MoE)."""

SPECIALS = [
    "[UNK]",
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
]

# Kimi-VL-A3B-Instruct's template.
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{'<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>'}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{'<|im_system|>'}}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{'<|im_user|>'}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{'<|im_assistant|>'}}{%- endif -%}"
    "{{- message['role'] -}}{{'<|im_middle|>'}}"
    "{%- if message['content'] is string -%}{{- message['content'] + '<|im_end|>' -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{{'<|media_start|>image<|media_content|><|media_pad|><|media_end|>'}}"
    "{%- else -%}{{content['text']}}{%- endif -%}"
    "{%- endfor -%}{{'<|im_end|>'}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<|im_assistant|>assistant<|im_middle|>'}}{%- endif -%}"
)


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS, unk="[UNK]")
    fast = mf._wrap_fast(
        tok,
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        model_max_length=131072,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    eos = [ids["[EOS]"], ids["<|im_end|>"]]
    text = {
        "model_type": "deepseek_v3",
        "vocab_size": n,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 800000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "pad_token_id": ids["[PAD]"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    vision = {
        "model_type": "moonvit",
        # HF names and the ones mlx-vlm's VisionConfig reads
        "num_hidden_layers": 2,
        "depth": 2,
        "num_attention_heads": 2,
        "num_heads": 2,
        "hidden_size": 32,
        "embed_dim": 32,
        "intermediate_size": 64,
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "merge_kernel_size": [2, 2],
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["KimiVLForConditionalGeneration"],
        "model_type": "kimi_vl",
        "ignore_index": -100,
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "vocab_size": n,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "pad_token_id": ids["[PAD]"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }
    files = {
        "preprocessor_config.json": {
            "image_mean": mf.CLIP_MEAN,
            "image_std": mf.CLIP_STD,
            "image_processor_type": "KimiVLImageProcessor",
            "in_token_limit": 4096,
            "merge_kernel_size": [2, 2],
            "pad_input": False,
            "patch_size": 14,
            "processor_class": "KimiVLProcessor",
        },
        "generation_config.json": mf.generation_config(ids["[BOS]"], eos, ids["[PAD]"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )
