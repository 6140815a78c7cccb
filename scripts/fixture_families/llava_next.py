"""LLaVA-NeXT (llava-hf/llava-v1.6-mistral-7b-hf shape): CLIP tower, 2-layer MLP projector, Mistral
text model, "anyres" tiling over image_grid_pinpoints.

Image tokens: the image processor picks the best pinpoint resolution (56x112, 112x56 or 112x112),
cuts it into 56x56 tiles and adds the whole image resized to 56x56 first: pixel_values
(1, 1 + tiles, 3, 56, 56), image_sizes (1, 2). The processor expands ``<image>`` to HF's
unpadded-feature count (base 4*4 patches + 1 CLS, plus the unpadded tile grid and one newline per
row, minus 1 for the "default" strategy); e.g. 64x48 -> 70 tokens.

mlx-vlm 0.7.10's model does not follow that count: it embeds every tile (16 features each, CLS
dropped), appends as many image_newline chunks as tiles, and puts one 16-feature chunk in place of
each of the first 2 x (1 + tiles) ``<image>`` tokens (dropping the rest), so the merged
embeddings are longer than the token ids (64x48: 160 image embeddings for 70 image tokens).

Prompt (mlx_vlm.prompt_utils.apply_chat_template, one image):
    '[INST] <image>\\nDescribe this image. [/INST]'   (the tokenizer adds <s>)
"""

TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + (message['content'] if message['content'] is string else message['content'][0]['text'])"
    " + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% endif %}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + (message['content'] if message['content'] is string else message['content'][0]['text']) + '</s> ' }}"
    "{% endif %}{% endfor %}"
)

SPECIALS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
TILE = 56
PINPOINTS = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]


def spec(mf):
    fast = mf.llava_tokenizer(SPECIALS, model_max_length=32768)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    n = len(fast)
    config = {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "model_type": "llava_next",
        "ignore_index": -100,
        "image_grid_pinpoints": PINPOINTS,
        "image_token_index": ids["<image>"],
        "projector_hidden_act": "gelu",
        "use_image_newline_parameter": True,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": n,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["</s>"],
        "bos_token_id": ids["<s>"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "vocab_size": n,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        "vision_config": mf.clip_vision_config(n, image_size=TILE),
    }
    files = {
        "preprocessor_config.json": {
            "aspect_ratio_setting": "anyres",
            "crop_size": {"height": TILE, "width": TILE},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_grid_pinpoints": PINPOINTS,
            "image_mean": mf.CLIP_MEAN,
            "image_processor_type": "LlavaNextImageProcessor",
            "image_std": mf.CLIP_STD,
            "processor_class": "LlavaNextProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": TILE},
        },
        "processor_config.json": {
            "image_token": "<image>",
            "num_additional_image_tokens": 1,
            "patch_size": 14,
            "processor_class": "LlavaNextProcessor",
            "vision_feature_select_strategy": "default",
        },
        "generation_config.json": mf.generation_config(ids["<s>"], ids["</s>"], ids["<pad>"]),
    }
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=[ids["</s>"]],
        never_ids=sorted(ids.values()),
    )
