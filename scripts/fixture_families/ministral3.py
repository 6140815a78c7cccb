"""Ministral 3 (Ministral-3-*-2512 shape): Mistral3's Pixtral tower and merger with the ministral3
text model, whose attention scales each query by its position past the rope's original length
(llama-4 scaling, yarn rope). That length is 16 here, so test prompts cross it."""


def spec(mf):
    out = mf.load_family("mistral3").spec(mf)
    text = out["config"]["text_config"]
    text.update(
        model_type="ministral3",
        architectures=["Ministral3ForCausalLM"],
        rope_parameters={
            "rope_type": "yarn",
            "type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        max_position_embeddings=8192,
    )
    text.pop("rope_theta", None)
    return out
