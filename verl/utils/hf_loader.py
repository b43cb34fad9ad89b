"""The documented import path `verl.utils.hf_loader.load_hf_model`; the loader lives in `verl.models.hf_loader`.

Kept as a re-export so user code and docs written against this path keep working; verl itself imports
from `verl.models.hf_loader`, which keeps `utils` below `models` in the layer order.
"""

from verl.models.hf_loader import (
    LoadReport,
    check_remote_code,
    load_hf_model,
    load_hf_model_with_report,
    load_tokenizer,
    quiet_hf_progress,
    resolve_attn_implementation,
    resolve_dtype,
)

__all__ = [
    "load_hf_model",
    "load_hf_model_with_report",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_attn_implementation",
    "check_remote_code",
    "quiet_hf_progress",
    "LoadReport",
]
