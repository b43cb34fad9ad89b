"""A config-only Qwen2 folder (config.json, no weights): what `verl check` plans memory for away from the weights."""

from __future__ import annotations

import json
from pathlib import Path


def write_qwen2_config(folder: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                       vocab: int) -> Path:
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": ffn, "vocab_size": vocab, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "torch_dtype": "bfloat16"}))
    return folder
