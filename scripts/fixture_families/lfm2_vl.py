"""LFM2-VL (LFM2-VL-450M shape): SigLIP2 NaFlex vision tower + pixel unshuffle, LFM2 hybrid
conv/attention text model. Images above the single-view budget are tiled
(`<|img_row_R_col_C|>` tiles plus a `<|img_thumbnail|>` view), as mlx-vlm's processor does."""

BASE_SPECIALS = [
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
]
TILE_SPECIALS = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)]
SPECIALS = BASE_SPECIALS + TILE_SPECIALS
# Real LFM2-VL checkpoints tie lm_head to embed_tokens. Untied here: tied, the builder zeroes the
# special tokens' input rows too, and the 4-bit variant's greedy output turns repetitive.
TIED = False

# LFM2-VL's template.
TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif content['type'] == 'text' -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def spec(mf):
    # No BOS post-processor: the template renders {{ bos_token }} itself.
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok,
        unk_token="<unk>",
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        extra_special_tokens={
            "image_token": "<image>",
            "image_start_token": "<|image_start|>",
            "image_end_token": "<|image_end|>",
            "image_thumbnail_token": "<|img_thumbnail|>",
        },
        model_max_length=128000,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    # Image budget (patch 8, downsample 2 -> 16 px per image token): a single view holds
    # 4..16 tokens (64x48 and 100x80 -> 48x64 -> 12 tokens); 224x160 is tiled into 3x2 tiles of
    # 32 px (4 tokens each) plus a 48x64 thumbnail.
    image = {
        "downsample_factor": 2,
        "encoder_patch_size": 8,
        "max_image_tokens": 16,
        "min_image_tokens": 4,
        "max_num_patches": 64,
        "max_pixels_tolerance": 2.0,
        "tile_size": 32,
        "min_tiles": 2,
        "max_tiles": 10,
        "do_image_splitting": True,
        "use_thumbnail": True,
    }
    config = {
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "model_type": "lfm2-vl",
        **image,
        "image_token_index": ids["<image>"],
        "image_token_id": ids["<image>"],
        "projector_bias": True,
        "projector_hidden_act": "gelu",
        "projector_hidden_size": 64,
        "use_image_special_tokens": True,
        "vision_feature_layer": -1,
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "lfm2",
            "vocab_size": n,
            "hidden_size": 64,
            "block_dim": 64,
            "conv_dim": 64,
            "conv_dim_out": 64,
            "intermediate_size": 128,
            "block_ff_dim": 128,
            "block_auto_adjust_ff_dim": True,
            "block_ffn_dim_multiplier": 1.0,
            "block_multiple_of": 64,
            "num_hidden_layers": 2,
            "layer_types": ["conv", "full_attention"],
            "num_attention_heads": 4,
            "num_heads": 4,
            "num_key_value_heads": 2,
            "conv_L_cache": 3,
            "conv_bias": False,
            "max_position_embeddings": 128000,
            "norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "bos_token_id": ids["<|startoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|pad|>"],
            "tie_word_embeddings": TIED,
            "use_cache": True,
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "siglip2_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_channels": 3,
            "patch_size": 8,
            "num_patches": 16,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
            "vision_use_head": False,
        },
    }
    files = {
        "preprocessor_config.json": {
            **image,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Lfm2VlImageProcessorFast",
            "processor_class": "Lfm2VlProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
        },
        "processor_config.json": {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True},
        "generation_config.json": mf.generation_config(ids["<|startoftext|>"], ids["<|im_end|>"], ids["<|pad|>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        never_ids=sorted(ids.values()),
    )
