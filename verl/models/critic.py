"""The PPO critic: a causal-LM backbone with a scalar value head, giving one value per token.

The backbone is the transformer without its LM head (`AutoModel`), either loaded from a path or deep-copied
from the actor, so critic and actor start from the same features but train separately. The head is kept in
float32 whatever the backbone dtype: values feed GAE, where bf16 rounding of returns is visible.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from verl.errors import CheckpointError, ModelError
from verl.models.lora import TRAINABLE_STATE_ONLY, apply_lora, is_peft_model, plain_copy
from verl.models.sharded_load import adapters_off_meta, defer_weights, is_deferred
from verl.models.signature import cache_argument, returned_cache, takes_cache
from verl.utils.positions import position_ids_from_mask

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_MARKER = "verl_critic.json"


def _backbone_of(causal_lm: nn.Module) -> nn.Module:
    base = getattr(causal_lm, "base_model", None)
    if isinstance(base, nn.Module) and base is not causal_lm:
        return base
    for name in ("model", "transformer"):
        module = getattr(causal_lm, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ModelError(f"cannot find the transformer backbone of {type(causal_lm).__name__} (no base_model, .model "
                     "or .transformer). Fix: pass a Hugging Face *ForCausalLM model, or build the critic with "
                     "ValueModel.from_pretrained(path).")


@dataclass
class ValueOutput(ModelOutput):
    """`ValueModel.forward(use_cache=True)`: the values and the backbone's KV cache (a ModelOutput, so that
    FSDP2 finds the values among the outputs it hooks for backward)."""

    values: torch.Tensor | None = None
    cache: Any = None


class ValueModel(nn.Module):
    """Backbone + ``nn.Linear(hidden, 1)``; ``forward(input_ids, attention_mask) -> values [B, T]`` in float32.

    The head starts at zero, so initial values are 0 and the first advantages equal the returns; its gradient
    is the hidden state, so learning starts immediately.
    """

    def __init__(self, backbone: nn.Module, *, hidden_size: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        config = getattr(backbone, "config", None)
        hidden = hidden_size or getattr(config, "hidden_size", None)
        if hidden is None and config is not None and hasattr(config, "get_text_config"):
            hidden = getattr(config.get_text_config(), "hidden_size", None)
        if hidden is None:
            raise ModelError(f"cannot tell the hidden size of backbone {type(backbone).__name__}. Fix: pass "
                             "hidden_size=... to ValueModel.")
        self.value_head = nn.Linear(int(hidden), 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, use_cache: bool = False,
                cache: Any = None, **kwargs: Any) -> torch.Tensor | ValueOutput:
        """Values for every position, ``[B, T]`` float32 (padding positions hold meaningless values).

        With `use_cache=True` (and optionally the `cache` of an earlier call to continue from) it returns a
        `ValueOutput` holding the values and the backbone's KV cache: the shared-prompt forward runs a
        group's prompt once and its responses on the cached keys/values (`verl.trainer.forward.logprobs`). Other
        keywords go to the backbone's layers (the packed forward's sequence lengths).
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        extra = {} if cache is None else {cache_argument(self.backbone): cache}
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, **extra, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # squeeze(-1) alone returns a view: FSDP2 hooks the root output's autograd node for its pre-backward
        # all-gather, and an in-place op on a view swaps that node out, so callers must get a fresh tensor.
        values = self.value_head(hidden.float()).squeeze(-1).clone()
        return ValueOutput(values=values, cache=returned_cache(out)) if use_cache else values

    def takes_cache(self) -> bool:
        """Whether the backbone continues from a KV cache (so `forward(use_cache=True)` is of use)."""
        return takes_cache(self.backbone)

    @classmethod
    def from_actor(cls, actor: nn.Module) -> ValueModel:
        """A critic whose backbone is a deep copy of the actor's (the actor is left untouched; a LoRA actor's
        adapters are merged into the copy, so the critic starts from the actor's current features).

        An actor built on the meta device (weights deferred, `verl.models.sharded_load`) has fresh
        adapters (zero B: merging them changes nothing), so its copy drops them and, deferred too, reads the
        actor's files when it is sharded."""
        if is_peft_model(actor):
            if is_deferred(actor):
                return cls(_backbone_of(copy.deepcopy(actor).unload()))
            return cls(_backbone_of(plain_copy(actor)))
        return cls(copy.deepcopy(_backbone_of(actor)))

    def add_lora(self, cfg: Any, *, base_model_name_or_path: str | None = None) -> ValueModel:
        """Freeze the backbone and train LoRA adapters on it (`critic.lora`); the value head trains in full.
        Checkpoints then hold the adapters and the head only."""
        with adapters_off_meta() if is_deferred(self.backbone) else contextlib.nullcontext():
            self.backbone = apply_lora(self.backbone, cfg, base_model_name_or_path=base_model_name_or_path,
                                       where="critic.lora", task_type=None)
        for p in self.value_head.parameters():
            p.requires_grad_(True)
        setattr(self, TRAINABLE_STATE_ONLY, True)
        return self

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, *,
                        attn_implementation: str | None = None, trust_remote_code: bool = False,
                        revision: str | None = None, defer: bool = False) -> ValueModel:
        """Load the backbone of a causal LM (or a saved critic) from ``path``; loads the head if saved there.
        ``tiny[:...]`` is built locally, as for ``model.path``. `defer`: the backbone is built on the meta
        device and each rank reads its part when it is sharded (`verl.models.sharded_load`; loaded
        whole where its files cannot be read that way)."""
        from transformers import AutoConfig, AutoModel

        from verl.models.hf_loader import check_remote_code, quiet_hf_progress, without_hub_kernels
        from verl.models.tiny import build_from_spec, is_tiny_spec
        from verl.utils.dtype import resolve_dtype

        path = os.fspath(path)
        if is_tiny_spec(path):
            path = build_from_spec(path, key="critic.path")
        torch_dtype = resolve_dtype(dtype, where="critic dtype")
        check_remote_code(path, trust_remote_code)
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code,
                                  "revision": revision}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        try:
            backbone = None
            if defer and not trust_remote_code and revision is None and Path(path).is_dir():
                config = AutoConfig.from_pretrained(path)
                with torch.device("meta"):
                    backbone = AutoModel.from_config(config, **{k: v for k, v in kwargs.items() if k != "revision"})
                if defer_weights(backbone, path):
                    backbone.config._name_or_path = backbone.name_or_path = path
                else:
                    backbone = None
            if backbone is None:
                with quiet_hf_progress():
                    backbone = without_hub_kernels(AutoModel.from_pretrained(path, **kwargs))
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
            raise ModelError(f"could not load a critic backbone from {path!r}: {type(exc).__name__}: {exc}. "
                             "Fix: point critic.path at a causal-LM directory (config.json + "
                             "safetensors) or a critic saved with ValueModel.save_pretrained.") from exc
        model = cls(backbone)
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            model.load_value_head(head)
        return model

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Save backbone (HF format) + head (safetensors), loadable with ``ValueModel.from_pretrained``."""
        from verl.models.hf_loader import quiet_hf_progress

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with quiet_hf_progress():
            self.backbone.save_pretrained(str(out))
        self.save_value_head(out / VALUE_HEAD_FILE)
        (out / CRITIC_MARKER).write_text(json.dumps({"value_head": VALUE_HEAD_FILE,
                                                     "hidden_size": self.value_head.in_features}) + "\n")

    def save_value_head(self, file: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  os.fspath(file))

    def load_value_head(self, file: str | os.PathLike) -> None:
        """Load head weights saved by `save_value_head`; shapes are checked so a wrong file fails loudly."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(os.fspath(file))
        except (OSError, RuntimeError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read the value head {file}: {exc}. Fix: re-save the critic with "
                                  "ValueModel.save_pretrained or delete the file to start from a fresh head.") from exc
        expected = {k: tuple(v.shape) for k, v in self.value_head.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if expected != found:
            raise CheckpointError(f"value head {file} has tensors {found} but this critic needs {expected} "
                                  "(hidden size differs). Fix: load it with the backbone it was trained with.")
        self.value_head.load_state_dict({k: v.float() for k, v in state.items()})


__all__ = ["ValueModel", "ValueOutput", "VALUE_HEAD_FILE"]
