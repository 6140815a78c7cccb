"""SmolVLM2 (HuggingFaceTB/SmolVLM2-256M-Video-Instruct shape): mlx-vlm's Idefics3 model with
SmolVLM's processor, a 16 px patch tower and a scale-4 pixel shuffle, SmolLM2 (Llama) text model.

Image tokens: the image processor resizes the longest edge to `size.longest_edge` (256), rounds
both sides up to multiples of `max_image_size.longest_edge` (128) and, when larger, splits it into
128x128 tiles plus a 128x128 global image. Every tile gives (128/16)**2 / scale_factor**2 = 4
``<image>`` tokens (image_seq_len), wrapped as ``<fake_token_around_image><row_r_col_c>`` +
4 x ``<image>`` per tile, then ``\\n<fake_token_around_image><global-img>`` + 4 x ``<image>`` +
``<fake_token_around_image>``. The fixture images (64x48, 100x80, 224x160) all become 2x2 tiles +
global: 5 tiles, 20 image tokens.

Prompt (mlx_vlm.prompt_utils.apply_chat_template, one image):
    '<|im_start|>User:<image>Describe this image.<end_of_utterance>\\nAssistant:'
The template renders ``<|im_start|>`` (the BOS) itself and the tokenizer adds none.
"""

TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

ROW_COL = [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    "<video>",
    *ROW_COL,
]

TILE = 128  # vision image_size = max_image_size.longest_edge
PATCH = 16
SCALE = 4
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2  # 4


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS, unk="<|endoftext|>")
    fast = mf._wrap_fast(
        tok,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "end_of_utterance_token": "<end_of_utterance>",
            "global_image_token": "<global-img>",
            "video_token": "<video>",
        },
        additional_special_tokens=[*ROW_COL],
        model_max_length=8192,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    eos = [ids["<end_of_utterance>"], ids["<|im_end|>"]]
    config = {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "image_token_id": ids["<image>"],
        "scale_factor": SCALE,
        "vocab_size": n,
        "pad_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|im_start|>"],
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama",
            "architectures": ["VLlama3ForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "vocab_size": n,
            "pad_token_id": ids["<|im_end|>"],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "smolvlm_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": PATCH,
            "image_size": TILE,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "max_image_size": {"longest_edge": TILE},
        },
    }
    files = {
        "preprocessor_config.json": {
            "do_convert_rgb": True,
            "do_image_splitting": True,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "SmolVLMImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "max_image_size": {"longest_edge": TILE},
            "processor_class": "SmolVLMProcessor",
            "resample": 1,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": 2 * TILE},
            "video_sampling": {"fps": 1, "max_frames": 8, "video_size": {"longest_edge": TILE}},
        },
        "processor_config.json": {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "SmolVLMProcessor"},
        "generation_config.json": {
            "bos_token_id": ids["<|im_start|>"],
            "eos_token_id": eos,
            "pad_token_id": ids["<|im_end|>"],
            "do_sample": False,
        },
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )
