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
SCALE = 4  # image_seq_len = (TILE // PATCH) ** 2 // SCALE**2 = 4


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
    )
    idefics3 = mf.load_family("idefics3")
    spec = idefics3.build_spec(
        mf, fast, SPECIALS, TEMPLATE, bos="<|im_start|>", pad="<|im_end|>", tile=TILE, patch=PATCH, scale=SCALE
    )
    config = spec["config"]
    config.update(architectures=["SmolVLMForConditionalGeneration"], model_type="smolvlm")
    config["text_config"].update(architectures=["VLlama3ForCausalLM"], head_dim=16, rope_theta=100000.0)
    config["vision_config"]["model_type"] = "smolvlm_vision"
    files = spec["files"]
    files["preprocessor_config.json"].update(
        image_processor_type="SmolVLMImageProcessor",
        processor_class="SmolVLMProcessor",
        video_sampling={"fps": 1, "max_frames": 8, "video_size": {"longest_edge": TILE}},
    )
    files["processor_config.json"]["processor_class"] = "SmolVLMProcessor"
    return spec
