"""Idefics3 (HuggingFaceM4/Idefics3-8B-Llama3 shape): SigLIP-style tower, pixel-shuffle connector,
Llama text model, image splitting into tiles plus a global image.

Image tokens: the image processor resizes the longest edge to `size.longest_edge` (112), rounds
both sides up to multiples of `max_image_size.longest_edge` (56) and, when larger, splits it into
56x56 tiles plus a 56x56 global image. Every tile gives (56/14)**2 / scale_factor**2 = 4
``<image>`` tokens (image_seq_len), wrapped as ``<fake_token_around_image><row_r_col_c>`` +
4 x ``<image>`` per tile, then ``\\n<fake_token_around_image><global-img>`` + 4 x ``<image>`` +
``<fake_token_around_image>``. The fixture images (64x48, 100x80, 224x160) all become 2x2 tiles +
global: 5 tiles, 20 image tokens.

Prompt (mlx_vlm.prompt_utils.apply_chat_template, one image):
    '<|begin_of_text|>User:<image>Describe this image.<end_of_utterance>\\nAssistant:'
The template renders the BOS itself and the tokenizer adds none.
"""

TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

ROW_COL = [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
SPECIALS = [
    "<unk>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *ROW_COL,
]

TILE = 56  # vision image_size = max_image_size.longest_edge
PATCH = 14
SCALE = 2  # image_seq_len = (TILE // PATCH) ** 2 // SCALE**2 = 4


def spec(mf):
    tok = mf.train_bpe(512, SPECIALS)
    fast = mf._wrap_fast(
        tok,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<end_of_utterance>",
        pad_token="<|end_of_text|>",
        additional_special_tokens=[
            "<fake_token_around_image>",
            "<image>",
            "<end_of_utterance>",
            "<global-img>",
            *ROW_COL,
        ],
        model_max_length=8192,
    )
    return build_spec(mf, fast, SPECIALS, TEMPLATE, bos="<|begin_of_text|>", pad="<|end_of_text|>", tile=TILE)


def build_spec(mf, fast, specials, template, *, bos, pad, tile, patch=PATCH, scale=SCALE):
    """The Idefics3 spec for this tokenizer and tile geometry; SmolVLM (smolvlm.py) is this one
    with its own names and text model."""
    ids = {t: fast.convert_tokens_to_ids(t) for t in specials}
    n = len(fast)
    eos = [ids["<end_of_utterance>"], ids[pad]]
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ids["<image>"],
        "scale_factor": scale,
        "vocab_size": n,
        "pad_token_id": ids[pad],
        "bos_token_id": ids[bos],
        "eos_token_id": eos,
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
            "rope_theta": 500000.0,
            "max_position_embeddings": 8192,
            "vocab_size": n,
            "pad_token_id": ids[pad],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "idefics3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": patch,
            "image_size": tile,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "max_image_size": {"longest_edge": tile},
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
            "image_processor_type": "Idefics3ImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "max_image_size": {"longest_edge": tile},
            "processor_class": "Idefics3Processor",
            "resample": 1,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": 2 * tile},
        },
        "processor_config.json": {
            "image_seq_len": (tile // patch) ** 2 // scale**2,
            "processor_class": "Idefics3Processor",
        },
        "generation_config.json": mf.generation_config(ids[bos], eos, ids[pad]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=template,
        files=files,
        eos_ids=eos,
        never_ids=sorted(ids.values()),
    )
