"""``verl ckpt export``: a verified checkpoint -> a plain Hugging Face folder any tool can load.

The trainer stores the model's HF config, generation config and tokenizer in the checkpoint's ``hf/``
folder, so export needs nothing from the hub: it rebuilds the architecture from that config, loads the DCP
``model`` weights into it (resharded to one process), and writes safetensors with ``save_pretrained``.
The result is written to a temporary folder and renamed into place, so a half-written export never exists.

A LoRA checkpoint holds only the adapters (its ``hf/adapter_config.json`` names the base model): export
loads the base weights from there (or ``base=``), puts the saved adapters on them and writes either the
merged weights (a plain model folder, the default) or the adapter folder that ``PeftModel.from_pretrained``
loads over the base (``adapter=True``).
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
from verl.utils.lora import ADAPTER_CONFIG, TRAINABLE_STATE_ONLY, require_peft


def is_reward_model_config(config: Any) -> bool:
    """A checkpoint of `trainer.kind: rm`: its HF config names a sequence-classification architecture."""
    return any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or ())


def _auto_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    if is_reward_model_config(config):
        return AutoModelForSequenceClassification
    vision = getattr(config, "vision_config", None) is not None  # Qwen2-VL-style: an image-text-to-text model
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def _default_factory(config: Any) -> torch.nn.Module:
    return _auto_class(config).from_config(config, trust_remote_code=False)


def export_hf(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    *,
    model_factory: Callable[[Any], torch.nn.Module] | None = None,
    model_key: str = "model",
    dtype: torch.dtype | None = None,
    adapter: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Write ``out_dir`` as a HF model folder from the ``model_key`` state of a checkpoint.

    ``model_factory(config) -> nn.Module`` builds the empty model (default:
    ``AutoModelForCausalLM.from_config``, or ``AutoModelForSequenceClassification`` for a reward model's
    checkpoint, whose config names that architecture); use it for a critic or a custom head. ``dtype`` casts the
    weights before writing (default: as trained). For a LoRA checkpoint, ``adapter=True`` writes the peft
    adapter folder instead of merged weights, and ``base`` says where the base model is when it is no
    longer where training loaded it from.
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
    if (hf / ADAPTER_CONFIG).is_file():
        return _export_lora(ckpt, out, hf, model_key=model_key, dtype=dtype, adapter=adapter, base=base)
    if adapter:
        raise CheckpointError(f"{ckpt}: --adapter asks for a LoRA adapter, but this checkpoint holds full weights "
                              f"(no {HF_DIR}/{ADAPTER_CONFIG}: it was trained with model.lora.rank=0). Fix: "
                              "export it without --adapter")
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=False)
    model = (model_factory or _default_factory)(config)
    load_checkpoint(ckpt, app_state={model_key: model})
    if (hf / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        # save_pretrained writes model.generation_config; keep the trained model's, not a fresh default
        model.generation_config = GenerationConfig.from_pretrained(str(hf))
    if dtype is not None:
        model = model.to(dtype)
    return _write(out, hf, model)


def _write(out: Path, hf: Path, model: Any, *, skip: tuple[str, ...] = (ADAPTER_CONFIG,)) -> Path:
    """``hf/`` (tokenizer, generation config; minus ``skip``) plus ``model.save_pretrained``, renamed into place."""
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    try:
        shutil.copytree(hf, tmp, ignore=shutil.ignore_patterns(*skip))  # config.json is rewritten below
        model.save_pretrained(str(tmp))  # transformers / peft write safetensors only
        if not any(tmp.glob("*.safetensors")):  # transformers >= 5 writes none on a rank other than 0
            raise CheckpointError(f"{out}: save_pretrained wrote no weights here (on rank "
                                  f"{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0} of "
                                  "a process group, transformers saves on rank 0 only). Fix: export on rank 0")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _export_lora(ckpt: Path, out: Path, hf: Path, *, model_key: str, dtype: torch.dtype | None, adapter: bool,
                 base: str | Path | None) -> Path:
    """Base weights + the checkpoint's adapters -> merged weights, or (``adapter``) the peft adapter folder."""
    from transformers import AutoConfig, GenerationConfig

    peft = require_peft("verl ckpt export (a LoRA checkpoint)")
    lora = peft.LoraConfig.from_pretrained(str(hf))
    lora.inference_mode = False  # the adapters load as the trainer held them: trainable
    base_path = str(base) if base is not None else lora.base_model_name_or_path
    if not base_path:
        raise CheckpointError(f"{hf / ADAPTER_CONFIG}: names no base model; pass the model the adapters were "
                              "trained on with --base DIR")
    config = AutoConfig.from_pretrained(str(hf))
    trained_dtype = getattr(config, "dtype", None)
    # A reward model's base is the causal LM it was trained from: its backbone loads into the classifier
    # (the trained score head comes from the checkpoint, with the adapters).
    extra = {"config": config} if is_reward_model_config(config) else {}
    try:
        model = _auto_class(config).from_pretrained(base_path, dtype=trained_dtype or torch.float32, **extra)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt}: the LoRA checkpoint's base model {base_path!r} cannot be loaded "
                              f"({type(exc).__name__}: {exc}). Fix: pass the base model's folder with --base DIR"
                              ) from None
    wrapped = peft.get_peft_model(model, lora)
    setattr(wrapped, TRAINABLE_STATE_ONLY, True)  # the checkpoint holds the trainable (adapter) state only
    load_checkpoint(ckpt, app_state={model_key: wrapped})
    if (hf / "generation_config.json").is_file():
        wrapped.get_base_model().generation_config = GenerationConfig.from_pretrained(str(hf))
    if adapter:
        keep = ("config.json", "generation_config.json", ADAPTER_CONFIG)  # the adapter folder: adapter + tokenizer
        return _write(out, hf, wrapped if dtype is None else wrapped.to(dtype), skip=keep)
    merged = wrapped.merge_and_unload()
    return _write(out, hf, merged if dtype is None else merged.to(dtype))
