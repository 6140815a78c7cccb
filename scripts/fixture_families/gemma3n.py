"""Gemma 3n (gemma3n): MobileNetV5 vision tower, AltUp/LAuReL text model with per-layer inputs
and KV-shared layers, audio tower.

Shapes follow google/gemma-3n-E2B-it, shrunk: text hidden 64, 4 layers (sliding, full, sliding,
full; the last two share the first two's KV: num_kv_shared_layers 2), per-layer inputs of 64.
The token space is laid out as the real one is, scaled down: text ids [0, 512) (they alone have
per-layer embeddings: vocab_size_per_layer_input), vision ids [512, 640) (embed_vision:
<end_of_image> = 512, <image_soft_token> = 513), audio ids [640, 768) (embed_audio:
<end_of_audio> = 640, <audio_soft_token> = 641).

mlx-vlm 0.7.10 hard-codes the MobileNetV5-300M vision tower (gemma3n_mobilenet_def, 294M
parameters, msfa output 2048 channels at 16x16 = 256 soft tokens per image): it cannot be made
tiny through the config, so this checkpoint is ~1.2 GB in float32. Images are resized to
256x256 (the smallest size whose stage-3 map is already 16x16, so no bicubic resampling);
every image is 256 <image_soft_token>s between "\\n\\n<start_of_image>" and "<end_of_image>\\n\\n".
The audio tower is configurable and is shrunk; no feature extractor is shipped (the processor
then runs without audio, as it does for a checkpoint whose feature extractor fails to load).
"""

from __future__ import annotations

TEXT_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<start_of_audio>",
]
TEXT_VOCAB = 512
VISION_VOCAB = 128
AUDIO_VOCAB = 128

# google/gemma-3n-E2B-it's template, trimmed (no tools); images and audio as their soft tokens.
TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n    {%- set loop_messages = messages -%}\n'
    "{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'audio' -%}\n                {{ '<audio_soft_token>' }}\n"
    "            {%- elif item['type'] == 'image' -%}\n                {{ '<image_soft_token>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)


def _tokenizer(mf):
    from tokenizers import AddedToken

    tok = mf.train_bpe(TEXT_VOCAB, TEXT_SPECIALS)
    filler = 0
    while tok.get_vocab_size() < TEXT_VOCAB:  # the text range is exactly [0, TEXT_VOCAB)
        tok.add_tokens([AddedToken(f"<unused{filler}>", special=True, normalized=False)])
        filler += 1
    assert tok.get_vocab_size() == TEXT_VOCAB, tok.get_vocab_size()
    vision = ["<end_of_image>", "<image_soft_token>"] + [f"<unused_v{i}>" for i in range(VISION_VOCAB - 2)]
    audio = ["<end_of_audio>", "<audio_soft_token>"] + [f"<unused_a{i}>" for i in range(AUDIO_VOCAB - 2)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vision + audio])
    fast = mf._wrap_fast(
        tok,
        **mf.GEMMA_TOKENIZER_SETTINGS,
        extra_special_tokens={
            **mf.GEMMA3_IMAGE_TOKENS,
            "audio_token": "<audio_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
        },
        model_max_length=32768,
    )
    return fast, vision, audio


def spec(mf):
    fast, vision, audio = _tokenizer(mf)
    ids = {t: fast.convert_tokens_to_ids(t) for t in TEXT_SPECIALS + vision[:2] + audio[:2]}
    assert ids["<end_of_image>"] == TEXT_VOCAB and ids["<audio_soft_token>"] == TEXT_VOCAB + VISION_VOCAB + 1
    n = len(fast)
    assert n == TEXT_VOCAB + VISION_VOCAB + AUDIO_VOCAB, n
    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    layers = 4
    text = {
        "model_type": "gemma3n_text",
        "hidden_size": 64,
        "intermediate_size": [128] * layers,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "num_kv_shared_layers": 2,
        "sliding_window": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "vocab_size": n,
        "vocab_size_per_layer_input": TEXT_VOCAB,
        "hidden_size_per_layer_input": 64,
        "laurel_rank": 64,
        "altup_num_inputs": 4,
        "altup_active_idx": 0,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 16,
        "pad_token_id": ids["<pad>"],
        "torch_dtype": "float32",
    }
    config = {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "boi_token_id": ids["<start_of_image>"],
        "eoi_token_id": ids["<end_of_image>"],
        "image_token_id": ids["<image_soft_token>"],
        "boa_token_id": ids["<start_of_audio>"],
        "eoa_token_id": ids["<end_of_audio>"],
        "audio_token_id": ids["<audio_soft_token>"],
        "vision_soft_tokens_per_image": 256,
        "audio_soft_tokens_per_image": 188,
        "hidden_size": 64,
        "vocab_size": n,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": {
            "model_type": "gemma3n_vision",
            "architecture": "mobilenetv5_300m_enc",
            "hidden_size": 2048,  # the hard-coded tower's msfa output channels
            "vocab_size": VISION_VOCAB,
            "vocab_offset": TEXT_VOCAB,
            "rms_norm_eps": 1e-6,
            "image_size": 256,
            "num_channels": 3,
        },
        "audio_config": {
            "model_type": "gemma3n_audio",
            "input_feat_size": 128,
            "hidden_size": 64,
            "conf_attention_chunk_size": 12,
            "conf_attention_context_left": 13,
            "conf_attention_context_right": 0,
            "conf_attention_logit_cap": 50.0,
            "conf_num_attention_heads": 2,
            "conf_num_hidden_layers": 1,
            "conf_conv_kernel_size": 5,
            "conf_reduction_factor": 4,
            "conf_residual_weight": 0.5,
            "sscp_conv_channel_size": [16, 8],
            "sscp_conv_kernel_size": [[3, 3], [3, 3]],
            "sscp_conv_stride_size": [[2, 2], [2, 2]],
            "vocab_size": AUDIO_VOCAB,
            "vocab_offset": TEXT_VOCAB + VISION_VOCAB,
            "rms_norm_eps": 1e-6,
        },
    }
    files = {
        "preprocessor_config.json": {
            "do_convert_rgb": None,
            "do_normalize": False,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "Gemma3nProcessor",
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 256, "width": 256},
        },
        "processor_config.json": {
            "audio_seq_length": 188,
            "image_seq_length": 256,
            "processor_class": "Gemma3nProcessor",
        },
        "generation_config.json": mf.generation_config(ids["<bos>"], eos, ids["<pad>"]),
    }
    # lm_head is tied to embed_tokens, so a zeroed lm_head row is a zero input embedding too; a
    # prompt token embedding to exactly zero makes AltUp divide 0 by 0 (its magnitude rescale:
    # NaN logits, greedy emits <pad>), so the text-range tokens that prompts hold (turn markers,
    # <bos>, <start_of_image>) keep their rows; greedy may then emit <end_of_turn> (EOS).
    in_prompts = {ids[t] for t in ("<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<start_of_audio>")}
    never = sorted(
        (
            set(ids.values())
            | set(range(TEXT_VOCAB, n))
            | {i for i in range(TEXT_VOCAB) if fast.convert_ids_to_tokens(i).startswith("<unused")}
        )
        - in_prompts
    )
    return dict(
        config=config,
        tokenizer=fast,
        template=TEMPLATE,
        files=files,
        eos_ids=eos,
        never_ids=never,
    )
