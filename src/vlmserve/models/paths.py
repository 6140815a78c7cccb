"""Where a model's files are: a local directory, or a Hugging Face repo id (no MLX here: the
serving process resolves it too, to load the processor while the engine loads the weights)."""

from __future__ import annotations

from pathlib import Path


def resolve_model_path(model: str, local_only: bool = False) -> Path:
    """A local directory, or a Hugging Face repo id fetched (or, `local_only`, only found in the
    cache) via huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model path not found: {model}")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]
    return Path(snapshot_download(model, allow_patterns=patterns, local_files_only=local_only))
