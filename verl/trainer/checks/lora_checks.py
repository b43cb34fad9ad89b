"""Start-up checks for LoRA (`model.lora`, `critic.lora`), before any weights load.

The model is built on the meta device from its config (no weights read, no memory used), so the module
names that `target_modules` must match and the shapes an adapter `path` must fit are known in a second.
The same pass counts trainable and total parameters, which `verl check` prints and the memory estimate
uses (gradients and optimizer moments only for what trains; no reference copy when the reference is
the policy with its adapters off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl.config.schema import LoraConfig, RunConfig
from verl.distributed.mapping import DeviceMapping
from verl.errors import ConfigError, DeviceMappingError, VerlError
from verl.models.lora import PEFT_HINT, peft_config, read_adapter_config
from verl.models.vision import is_vision_language


@dataclass
class ParameterCounts:
    """Trainable and total parameters of the policy (and critic) as the run will train them."""

    total: int
    trainable: int
    lora: LoraConfig | None = None
    critic_trainable: int | None = None  # critic.lora: the critic's trainable parameters (backbone LoRA + head)
    adapter_off_reference: bool = False  # the reference is the policy with its adapters off (no copy)

    def describe(self) -> str:
        share = 100.0 * self.trainable / max(self.total, 1)
        text = f"parameters: {self.total:,} total, {self.trainable:,} trainable ({share:.2f}%)"
        if self.lora is not None:
            what = f"adapter {self.lora.path}" if self.lora.path else (
                f"rank {self.lora.rank}, alpha {self.lora.scale_alpha:g}, target_modules={self.lora.target_modules}")
            text += f"; LoRA: {what}"
        if self.critic_trainable is not None:
            text += f"; critic (LoRA): {self.critic_trainable:,} trainable"
        if self.adapter_off_reference:
            text += "\nreference: the policy with its adapters off (no second copy of the weights)"
        return text


@dataclass
class LoraCheck:
    problems: list[VerlError] = field(default_factory=list)
    counts: ParameterCounts | None = None


def meta_causal_lm(path: str, *, trust_remote_code: bool = False,
                   revision: str | None = None) -> torch.nn.Module | None:
    """The causal LM of `path` on the meta device (from its config only), or None when it cannot be built
    here (a hub id not downloaded yet, an unreadable folder: the model check reports those)."""
    if not Path(path).expanduser().exists():
        return None
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except Exception:
        return None
    return meta_model_of(cfg, trust_remote_code=trust_remote_code)


def meta_model_of(cfg: Any, *, trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The model of a Hugging Face config on the meta device: a causal LM, or a vision-language model with its
    vision tower (image-text-to-text); None when transformers cannot build it here."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(cfg) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(cfg, trust_remote_code=trust_remote_code)
    except Exception:
        return None


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct leaf names of the model's linear layers (what `target_modules` lists)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _matches(module_names: list[str], key: str) -> bool:
    return any(name == key or name.endswith("." + key) for name in module_names)


def _same_base(recorded: str | None, config_path: str, resolved: str | None) -> bool:
    if not recorded:
        return True  # the adapter does not say; the shapes decide
    candidates = {config_path, resolved or config_path}
    if recorded in candidates:
        return True
    real = {os.path.realpath(os.path.expanduser(c)) for c in candidates if Path(c).expanduser().exists()}
    return Path(recorded).expanduser().exists() and os.path.realpath(os.path.expanduser(recorded)) in real


def _adapter_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the adapter's weights file, from the safetensors header only."""
    folder = Path(path)
    file = folder / "adapter_model.safetensors"
    if file.is_file():
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    file = folder / "adapter_model.bin"
    if file.is_file():
        return {k: tuple(v.shape) for k, v in torch.load(file, map_location="meta", weights_only=True).items()}
    return {}


def _check_adapter_path(section: str, cfg: LoraConfig, model: torch.nn.Module | None, config: RunConfig,
                        resolved: str | None) -> list[VerlError]:
    path = cfg.path
    if not Path(path).expanduser().is_dir():
        return [ConfigError(f"{section}.path={path}: no such folder; point it at a peft adapter folder "
                            "(adapter_config.json + adapter_model.safetensors), or remove the key to start "
                            "new adapters")]
    try:
        adapter = read_adapter_config(path, where=f"{section}.path")
    except ConfigError as exc:
        return [exc]
    problems: list[VerlError] = []
    recorded = adapter.get("base_model_name_or_path")
    base_path = config.critic.path or config.model.path if section == "critic.lora" else config.model.path
    if not _same_base(recorded, base_path, resolved if section == "model.lora" else None):
        problems.append(ConfigError(
            f"{section}.path={path} was trained on base model {recorded!r}, but this run's model is "
            f"{base_path!r}; an adapter only fits the model it was trained on. Fix: set the model path to "
            f"{recorded!r}, or use an adapter trained on {base_path!r}"))
    r = adapter.get("r")
    if cfg.rank > 0 and r is not None and int(r) != cfg.rank:
        problems.append(ConfigError(
            f"{section}.rank={cfg.rank} but the adapter at {section}.path={path} has rank {r} (its own rank, "
            f"alpha and target modules apply). Fix: set {section}.rank={r} or {section}.rank=0"))
    if model is not None:
        modules = dict(model.named_modules())
        wrong = []
        for key, shape in _adapter_shapes(path).items():
            for kind, dim in ((".lora_A.", 1), (".lora_B.", 0)):
                if kind not in key or len(shape) != 2:
                    continue
                name = key.split(kind)[0].removeprefix("base_model.model.")
                if section == "critic.lora":
                    name = name.removeprefix("model.")
                    modules_here = {n.removeprefix("model."): m for n, m in modules.items()}
                else:
                    modules_here = modules
                layer = modules_here.get(name)
                want = None
                if isinstance(layer, torch.nn.Linear):
                    want = layer.in_features if dim == 1 else layer.out_features
                if layer is None or want != shape[dim]:
                    wrong.append(f"{key} {list(shape)}" + ("" if layer is not None else " (no such module)"))
        if wrong:
            problems.append(ConfigError(
                f"{section}.path={path}: the adapter's shapes do not fit this run's model {base_path!r} "
                f"({len(wrong)} tensor(s), e.g. {', '.join(wrong[:3])}); it was trained on another base "
                f"model ({recorded!r}). Fix: use the base model the adapter was trained on, or another adapter"))
    return problems


def _check_section(section: str, cfg: LoraConfig, model: torch.nn.Module | None, config: RunConfig,
                   resolved: str | None) -> list[VerlError]:
    problems: list[VerlError] = []
    if cfg.rank < 0 or (cfg.rank == 0 and cfg.path is None):
        problems.append(ConfigError(f"{section}.rank={cfg.rank}: a LoRA rank must be > 0 (0 turns LoRA off). "
                                    f"Fix: set {section}.rank to e.g. 8 or 16, or 0 to train every weight"))
    if cfg.alpha is not None and cfg.alpha <= 0:
        problems.append(ConfigError(f"{section}.alpha={cfg.alpha:g}: must be > 0 (the adapters are scaled by "
                                    f"alpha / rank). Fix: set {section}.alpha to e.g. 2 x rank, or remove it "
                                    "(default 2 x rank)"))
    try:
        import peft  # noqa: F401
    except ImportError:
        problems.append(ConfigError(f"{section}: LoRA is on, but the `peft` package is not installed. "
                                    f"Fix: {PEFT_HINT}, or set {section}.rank=0 to train every weight"))
    if model is not None and not cfg.path:
        names = [n for n, _ in model.named_modules()]
        targets = [] if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
        if not targets and cfg.target_modules != "all-linear":
            problems.append(ConfigError(f"{section}.target_modules is empty; use 'all-linear' or list module "
                                        f"names, e.g. {_linear_names(model)}"))
        missing = [t for t in targets if not _matches(names, t)]
        if missing:
            problems.append(ConfigError(
                f"{section}.target_modules names {missing}, which match no module of {type(model).__name__}; "
                f"its linear layers are {_linear_names(model)}. Fix: list some of those, or use 'all-linear'"))
        missing = [t for t in cfg.modules_to_save or [] if not _matches(names, t)]
        if missing:
            top = sorted({n.rsplit(".", 1)[-1] for n in names if n and "." not in n.split("layers.")[-1]})
            problems.append(ConfigError(
                f"{section}.modules_to_save names {missing}, which match no module of {type(model).__name__} "
                f"(e.g. {top}). Fix: name existing modules (e.g. lm_head, embed_tokens) or remove the key"))
    if cfg.path:
        problems += _check_adapter_path(section, cfg, model, config, resolved)
    return problems


def _trainable_with_lora(model: torch.nn.Module, cfg: LoraConfig, *, task_type: str | None) -> tuple[int, int]:
    """(trainable, total) parameters once `cfg`'s adapters are on `model` (a meta-device copy: no memory)."""
    import copy

    import peft

    if cfg.path:
        config = peft.LoraConfig.from_pretrained(cfg.path)
        config.inference_mode = False
    else:
        config = peft_config(cfg, base_model_name_or_path=None, task_type=task_type)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    return (sum(p.numel() for p in wrapped.parameters() if p.requires_grad),
            sum(p.numel() for p in wrapped.parameters()))


def check_lora(config: RunConfig, *, model_path: str | None, mapping: DeviceMapping | None = None, kind: str = "rl",
               model: torch.nn.Module | None = None) -> LoraCheck:
    """Every LoRA problem of `config` (collected, not raised) and the parameter counts for `verl check`;
    `model`: the policy on the meta device when the caller built it already (`PolicyFacts.meta_model`)."""
    out = LoraCheck()
    lora, critic_lora = config.model.lora, config.critic.lora
    sections = [("model.lora", lora)] if lora.enabled else []
    critic_on = kind == "rl" and config.needs_critic and critic_lora.enabled
    if critic_on:
        sections.append(("critic.lora", critic_lora))
    if model is None and model_path is not None:
        model = meta_causal_lm(model_path, trust_remote_code=config.model.trust_remote_code,
                               revision=config.model.revision)
    for section, cfg in sections:
        critic_model = model
        if section == "critic.lora" and config.critic.path:
            critic_model = meta_causal_lm(config.critic.path, trust_remote_code=config.model.trust_remote_code)
        out.problems += _check_section(section, cfg, critic_model, config, model_path)
    if (lora.enabled and kind == "rl" and config.needs_ref and not config.ref.path and mapping is not None
            and "ref" in mapping.roles):
        actor, ref = set(mapping.ranks("actor")), set(mapping.ranks("ref"))
        if actor != ref and actor & ref:
            out.problems.append(DeviceMappingError(
                f"model.lora with devices.ref={sorted(ref)} overlapping devices.actor={sorted(actor)}: with LoRA "
                "the reference is the policy with its adapters off, which runs on the actor's ranks (or, on "
                "ranks of its own, on their unsharded copy of the base weights); a reference on some but not "
                f"all actor ranks has neither. Fix: set devices.ref={sorted(actor)} (or remove it), put the "
                "reference on ranks apart from the actor's, or give a separate reference with ref.path"))
    if out.problems or model is None:
        return out
    total = sum(p.numel() for p in model.parameters())
    trainable = total
    if lora.enabled:
        trainable, total = _trainable_with_lora(model, lora, task_type="CAUSAL_LM")
    critic_trainable = None
    if critic_on and not config.critic.path:
        backbone = model.model if hasattr(model, "model") else model
        critic_trainable = (_trainable_with_lora(backbone, critic_lora, task_type=None)[0]
                            + backbone.config.hidden_size + 1)  # + the value head
    adapter_off_ref = lora.enabled and not config.ref.path and (config.needs_ref if kind == "rl" else kind == "dpo")
    out.counts = ParameterCounts(total=total, trainable=trainable, lora=lora if lora.enabled else None,
                                 critic_trainable=critic_trainable, adapter_off_reference=adapter_off_ref)
    return out


def memory_counts(config: RunConfig, counts: ParameterCounts,
                  mapping: DeviceMapping) -> tuple[dict[str, int], dict[str, int]]:
    """(parameters, trainable parameters) per role for the memory estimate: with LoRA the actor's gradients
    and optimizer moments cover the adapters only, and a reference that is the policy with its adapters off
    costs nothing where it shares the actor's ranks."""
    params = {role: counts.total for role in mapping.roles if role != "reward"}
    trainable = {"actor": counts.trainable, "critic": counts.critic_trainable or counts.total}
    lora = config.model.lora
    if lora.enabled and not config.ref.path and "ref" in params and mapping.ranks("ref") == mapping.ranks("actor"):
        params["ref"] = 0
    return params, trainable


def uses_lora(config: RunConfig) -> bool:
    return config.model.lora.enabled or config.critic.lora.enabled


__all__ = ["LoraCheck", "ParameterCounts", "check_lora", "memory_counts", "meta_causal_lm", "meta_model_of",
           "uses_lora"]
