"""``verl ckpt export``: a verified checkpoint -> a plain Hugging Face folder any tool can load.

The trainer stores the model's HF config, generation config and tokenizer in the checkpoint's ``hf/``
folder, so export needs nothing from the hub: it rebuilds the architecture from that config, loads the DCP
``model`` weights into it (resharded to one process), and writes safetensors with ``save_pretrained``.
The result is written to a temporary folder and renamed into place, so a half-written export never exists.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl.checkpoint.manager import HF_DIR, load_checkpoint
from verl.checkpoint.manifest import verify
from verl.errors import CheckpointError


def _default_factory(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def export_hf(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    *,
    model_factory: Callable[[Any], torch.nn.Module] | None = None,
    model_key: str = "model",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``out_dir`` as a HF model folder from the ``model_key`` state of a checkpoint.

    ``model_factory(config) -> nn.Module`` builds the empty model (default:
    ``AutoModelForCausalLM.from_config``); use it for a critic or a custom head. ``dtype`` casts the
    weights before writing (default: as trained).
    """
    from transformers import AutoConfig

    ckpt = Path(checkpoint_path)
    out = Path(out_dir)
    problems = verify(ckpt)
    if problems:
        raise CheckpointError(
            f"{ckpt}: refusing to export a checkpoint that does not verify:\n  " + "\n  ".join(problems)
        )
    hf = ckpt / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(
            f"{hf / 'config.json'}: missing; this checkpoint was saved without its Hugging Face config "
            "(CheckpointManager.save(..., hf_assets=(model.config, model.generation_config, tokenizer))), "
            "so there is no architecture to export into."
        )
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; pass a new --out folder or remove it.")
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=False)
    model = (model_factory or _default_factory)(config)
    load_checkpoint(ckpt, app_state={model_key: model})
    if (hf / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        # save_pretrained writes model.generation_config; keep the trained model's, not a fresh default
        model.generation_config = GenerationConfig.from_pretrained(str(hf))
    if dtype is not None:
        model = model.to(dtype)
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    try:
        shutil.copytree(hf, tmp)  # tokenizer + generation config; config.json is rewritten below
        model.save_pretrained(str(tmp))  # transformers writes safetensors only
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
