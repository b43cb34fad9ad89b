"""`load_hf_model`: load a causal LM and its tokenizer, and refuse combinations that would train garbage.

The failures guarded against here all let training run "fine": a base tokenizer with an instruct model (the
chat template's special tokens become text fragments), pad None, an eos the model never emits, ids past
the embedding matrix. Environment mistakes (FlashAttention missing, fp16 on CPU, bf16 on an old GPU,
remote code) are refused before any weights are read. The checks themselves live in
`verl.models.checks`, so the trainer's start-up and `verl check model` run exactly the same ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from verl.errors import ModelError
from verl.models.checks import LoadReport, check_model_and_tokenizer
from verl.models.sharded_load import defer_weights
from verl.models.vision import is_vision_language, load_processor
from verl.models.vision_checks import vision_problems, vision_summary
from verl.utils.dtype import check_dtype_for_device, dtype_name, resolve_dtype
from verl.utils.suggest import did_you_mean
from verl.utils.tokenizer_protocol import Tokenizer

# How each loader argument is spelled in the messages: Python callers see the argument names; the trainer
# passes CONFIG_KEYS so a config user reads the key to change (`model.dtype`, not `torch_dtype`).
CONFIG_KEYS = {"tokenizer_name": "model.tokenizer_path", "torch_dtype": "model.dtype",
               "attn_implementation": "model.attn_implementation", "trust_remote_code": "model.trust_remote_code",
               "device": "trainer.device"}

def _verb(key: str) -> str:
    return "set" if "." in key else "pass"  # a config key is set, a Python argument is passed


ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
MIN_TRANSFORMERS_FOR_REMOTE_CODE = (4, 40)


def _transformers_version() -> tuple[int, int]:
    import transformers

    match = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def without_hub_kernels(model: Any) -> Any:
    """`model` on its own torch layers: transformers >= 5 kernelizes what it loads with Hub kernels (code fetched
    from the Hub, which only `trust_remote_code` may allow here) and kernelizes again at every train()/eval()
    switch, a walk of the whole model that a training step pays several times. Same outputs where no Hub kernel
    was fetched (the CPU case); returns `model`."""
    if getattr(model, "use_kernels", False) and hasattr(model, "reset_kernels"):
        model.reset_kernels()
    return model


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """Hide transformers' per-file progress bars, which flood logs of short runs and tests."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


LIBRARY_WARNING_MODULES = r"(transformers|peft|accelerate|huggingface_hub)(\.|$)"


def quiet_hf_console() -> None:
    """For a CLI run: transformers' logger at ERROR, no progress bars, no FutureWarnings from the HF libraries,
    so their lines do not interleave with verl's step lines (verl reports what matters of a load itself:
    missing weights, dtype, remote code). `TRANSFORMERS_VERBOSITY` set by the user wins and keeps them all."""
    if os.environ.get("TRANSFORMERS_VERBOSITY"):
        return
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=LIBRARY_WARNING_MODULES)


def _looks_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name) or name.count("/") > 1


def _check_source(name: str, role: str) -> None:
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        raise ModelError(f"{role}={name!r} must be a local directory or a Hugging Face model id such as "
                         "'Qwen/Qwen2.5-0.5B-Instruct'.")
    name = os.fspath(name)
    if _looks_local(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ModelError(f"{role} {name!r} is not a directory. Fix: pass the directory that holds "
                             "config.json (e.g. the output of save_pretrained), or a Hugging Face model id.")


def _local_config(name: str) -> dict[str, Any] | None:
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}). Fix: restore config.json from the original "
                         "checkpoint.") from exc


def check_remote_code(name: str, trust_remote_code: bool, *, key: str = "trust_remote_code") -> None:
    """Refuse remote code on old transformers, and say so clearly when a model needs it and it is off."""
    if trust_remote_code and _transformers_version() < MIN_TRANSFORMERS_FOR_REMOTE_CODE:
        import transformers

        raise ModelError(
            f"{key}=True needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS_FOR_REMOTE_CODE))}, "
            f"but {transformers.__version__} is installed (older versions run remote code without the checks "
            "this project relies on). Fix: pip install -U 'transformers>=4.40'.")
    config = _local_config(name) if _looks_local(name) else None
    if config is None or trust_remote_code or "auto_map" not in config:
        return
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type", "")
    if model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"model {name!r} (model_type={model_type!r}) ships its own Python code (auto_map in config.json) "
            "that transformers does not include, and trust_remote_code is off by default because that code "
            f"runs with your permissions. Fix: read the code, then {_verb(key)} {key}=True, or use a model whose "
            "architecture transformers supports natively.")


def resolve_attn_implementation(use_flash_attention_2: bool, attn_implementation: str | None,
                                device_type: str, *, key: str = "attn_implementation") -> str | None:
    """Pick the attention implementation, refusing FlashAttention where it cannot run."""
    if use_flash_attention_2:
        if attn_implementation not in (None, "flash_attention_2"):
            raise ModelError(
                f"use_flash_attention_2=True conflicts with attn_implementation={attn_implementation!r}. Fix: "
                "pass only attn_implementation (use_flash_attention_2 is the older spelling of "
                "attn_implementation='flash_attention_2').")
        attn_implementation = "flash_attention_2"
    if attn_implementation is None:
        return None
    if attn_implementation not in ATTN_IMPLEMENTATIONS and "/" not in attn_implementation:
        hint = did_you_mean(attn_implementation, ATTN_IMPLEMENTATIONS)
        raise ModelError(f"{key}={attn_implementation!r} is not known.{hint} Use one of "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)} (or a kernels-hub id such as 'org/kernel').")
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        package = "flash_attn" if attn_implementation == "flash_attention_2" else "flash_attn_interface"
        if importlib.util.find_spec(package) is None:
            raise ModelError(
                f"{key}={attn_implementation} was requested but the {package} package is not installed. Fix: use "
                f"{key}=\"sdpa\" (PyTorch's fused attention, no extra package), or install it "
                "with `pip install flash-attn --no-build-isolation` on a CUDA machine.")
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ModelError(
                f"{key}={attn_implementation} was requested but it only runs on CUDA GPUs and the model will run "
                f"on {device_type}. Fix: use {key}=\"sdpa\" (or \"eager\") on this device.")
    return attn_implementation


def _target_device(device: str | torch.device | None, key: str = "device",
                   weights: bool = True) -> tuple[torch.device | None, str]:
    """The device to load onto and its type; a CUDA one needs CUDA here only when weights are loaded (a meta
    build checks a GPU run on a machine without one, e.g. `verl check` on a login node)."""
    if device is None:
        return None, "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"{key}={device!r} is not a valid torch device ({exc}). Fix: use 'cpu', 'cuda' or "
                         "'cuda:N'.") from exc
    if dev.type == "cuda" and weights and not torch.cuda.is_available():
        raise ModelError(f"{key}={device!r} was requested but CUDA is not available on this machine. Fix: "
                         f"use {key}=cpu (with dtype fp32) or install a CUDA build of torch.")
    return dev, dev.type


def load_tokenizer(name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Tokenizer:
    """Load a tokenizer with AutoTokenizer, turning loader exceptions into a ModelError that says the fix."""
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    _check_source(name, "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise ModelError(
            f"could not load a tokenizer from {name!r}: {type(exc).__name__}: {exc}. Fix: point to a directory "
            "with tokenizer.json/tokenizer_config.json (the model's own directory normally has them) or a "
            "Hugging Face id that is downloaded to the local cache.") from exc


def _has_tokenizer_files(name: str) -> bool:
    path = Path(name).expanduser()
    return path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model", "vocab.json"))


def _missing_weights(name: str) -> str | None:
    """Without reading them: whether a local model folder lacks weight files (`verl check` builds on meta,
    and may plan from a config-only folder, so this is a warning there)."""
    path = Path(name).expanduser()
    if path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        return (f"model {name!r} has a config but no weights (no *.safetensors or pytorch_model*.bin in the "
                "folder): training would fail to load it. Fix: copy the weight files there before training")
    return None


def load_hf_model_with_report(
    model_name: str,
    *,
    tokenizer_name: str | None = None,
    use_flash_attention_2: bool = False,
    attn_implementation: str | None = None,
    torch_dtype: str | torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    device: str | torch.device | None = None,
    revision: str | None = None,
    for_training: bool = True,
    chat: bool | None = None,
    pad_token: str | None = None,
    eos_token: str | None = None,
    model_class: Any = None,
    names: dict[str, str] | None = None,
    tokenizer: Tokenizer | None = None,
    weights: bool = True,
    defer: bool = False,
) -> tuple[Any, Tokenizer, LoadReport]:
    """`load_hf_model` without raising on model/tokenizer problems: they are in the returned report.

    `tokenizer` is one already loaded (and compared with the model's own) by the caller, so it is not
    loaded again. `weights=False` builds the model on the meta device from its config: every check runs,
    nothing is read or allocated (`verl check`). `defer=True` (a role about to be sharded over several ranks)
    also builds it on the meta device, recording where each weight lies in the safetensors files, so that
    after sharding each rank reads only its part (`verl.models.sharded_load`); where the files cannot
    be read that way (.bin, a hub id, remote code) it loads the model as `weights=True` does.

    Environment problems (dtype, device, attention, remote code, missing files) still raise ModelError,
    because nothing can be loaded past them. `verl check model` uses this to print every problem at once.
    `names` spells the arguments in messages (`CONFIG_KEYS` for a config: `model.dtype`, not `torch_dtype`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model_name = os.fspath(model_name)
    tokenizer_source = os.fspath(tokenizer_name) if tokenizer_name is not None else model_name
    names = names or {}
    key = {arg: names.get(arg, arg) for arg in CONFIG_KEYS}
    _check_source(model_name, "model")
    target, device_type = _target_device(device, key["device"], weights)
    attn = resolve_attn_implementation(use_flash_attention_2, attn_implementation, device_type,
                                       key=key["attn_implementation"])
    check_remote_code(model_name, trust_remote_code, key=key["trust_remote_code"])

    try:
        config = AutoConfig.from_pretrained(model_name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        needs_code = "trust_remote_code" in str(exc)
        fix = (f"the model needs its own code: if you trust it, {_verb(key['trust_remote_code'])} "
               f"{key['trust_remote_code']}=True" if needs_code else
               "check the name; without internet, download the model elsewhere (`huggingface-cli download "
               "NAME`) and pass the local directory")
        raise ModelError(f"could not load the config of model {model_name!r}: {exc}. Fix: {fix}.") from exc

    if isinstance(torch_dtype, str) and torch_dtype.strip().lower() == "auto":
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = resolve_dtype(stored, where=f"{key['torch_dtype']}=auto (from the checkpoint's config)")
    else:
        dtype = resolve_dtype(torch_dtype, where=key["torch_dtype"])
    check_dtype_for_device(dtype, device_type, where=key["torch_dtype"])

    reference = None
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_source, revision=revision if tokenizer_name is None else None,
                                   trust_remote_code=trust_remote_code)
        if tokenizer_source != model_name and (_has_tokenizer_files(model_name) or not _looks_local(model_name)):
            try:
                reference = load_tokenizer(model_name, revision=revision, trust_remote_code=trust_remote_code)
            except ModelError:
                reference = None  # weights-only directory with stray files: nothing to compare against

    vision = is_vision_language(config)
    processor = None
    if vision:
        # The folder's processor, with the tokenizer just loaded when it comes from the same folder (one object,
        # so pad/eos fixes reach both); a substitute tokenizer is compared with the processor's own below.
        processor = load_processor(model_name, revision=revision, trust_remote_code=trust_remote_code,
                                   tokenizer=tokenizer if tokenizer_source == model_name else None)
    auto = model_class or (_image_text_auto() if vision else AutoModelForCausalLM)
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "revision": revision,
                              "trust_remote_code": trust_remote_code}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    deferred = False
    try:
        if not weights or (defer and not trust_remote_code):
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                         **({"attn_implementation": attn} if attn is not None else {}))
            if weights:
                directory = _weights_dir(model_name, revision)
                deferred = directory is not None and defer_weights(model, directory)
                if deferred:
                    _as_from_pretrained(model, model_name, directory)
        if weights and not deferred:
            with quiet_hf_progress():
                model = without_hub_kernels(auto.from_pretrained(model_name, **kwargs))
    except (OSError, ValueError, ImportError, KeyError, RuntimeError, SafetensorError) as exc:
        raise ModelError(
            f"could not load the weights of model {model_name!r} as {getattr(auto, '__name__', auto)}: "
            f"{type(exc).__name__}: {exc}. Fix: check that the directory holds model.safetensors (or sharded "
            "safetensors) matching config.json, and that the architecture is a causal LM.") from exc

    if target is not None and weights and not deferred:
        model.to(target)
    if for_training:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)

    report = check_model_and_tokenizer(model, tokenizer, chat=chat, model_source=model_name,
                                       tokenizer_source=tokenizer_source, reference_tokenizer=reference,
                                       pad_token=pad_token, eos_token=eos_token, fix=True,
                                       tokenizer_key=key["tokenizer_name"])
    if vision:
        both = (f"(model {model_name}, tokenizer {tokenizer_source})" if tokenizer_source != model_name
                else f"({model_name})")
        report.problems += vision_problems(model, tokenizer, processor, where=both, chat=chat,
                                           tokenizer_key=key["tokenizer_name"],
                                           processor_source=f"the processor loaded from {model_name}")
        if processor.tokenizer is not tokenizer and not report.problems:
            processor.tokenizer = tokenizer  # same vocabulary (checked): one tokenizer object for the run
        report.processor = processor
        report.vision = vision_summary(model, processor)
    if not weights and (missing := _missing_weights(model_name)):
        report.warnings.append(missing)
    first = next(model.parameters(), None)
    report.revision = revision
    report.dtype = dtype_name(first.dtype) if first is not None else dtype_name(dtype)
    report.attn_implementation = str(getattr(model.config, "_attn_implementation", None) or attn or "default")
    report.device = str(target or device_type) if deferred else str(first.device) if first is not None else "cpu"
    report.num_parameters = sum(p.numel() for p in model.parameters())
    report.num_trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report.trust_remote_code = trust_remote_code
    model.verl_load_report = report
    return model, tokenizer, report


def _image_text_auto() -> Any:
    """The auto class of vision-language models (named AutoModelForVision2Seq before transformers 4.50)."""
    import transformers

    return getattr(transformers, "AutoModelForImageTextToText", None) or transformers.AutoModelForVision2Seq


def _weights_dir(name: str, revision: str | None) -> str | None:
    """The local folder of `name`'s files: the folder itself, or a hub id's snapshot already in the Hugging
    Face cache (None otherwise: the caller loads whole, downloading as `from_pretrained` does)."""
    if _looks_local(name):
        return str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or no hub client: load the old way
        return None


def _as_from_pretrained(model: Any, model_name: str, directory: str) -> None:
    """What `from_pretrained` sets beyond the weights: the source's name and its generation config."""
    from transformers import GenerationConfig

    model.config._name_or_path = model_name
    model.name_or_path = model_name
    if getattr(model, "generation_config", None) is not None and (Path(directory) / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise ModelError(f"could not read {directory}/generation_config.json: {exc}. Fix: restore the file "
                             "from the original checkpoint, or delete it.") from exc


def load_hf_model(
    model_name: str,
    *,
    tokenizer_name: str | None = None,
    use_flash_attention_2: bool = False,
    attn_implementation: str | None = None,
    torch_dtype: str | torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    device: str | torch.device | None = None,
    revision: str | None = None,
    for_training: bool = True,
    chat: bool | None = None,
    pad_token: str | None = None,
    eos_token: str | None = None,
    return_processor: bool = False,
) -> tuple[Any, Tokenizer] | tuple[Any, Tokenizer, Any]:
    """Load a causal LM and its tokenizer, checked against each other; returns ``(model, tokenizer)``.

    Raises ModelError (what, where, fix) for every mismatch `verl.models.checks` finds; the full report is
    attached as ``model.verl_load_report``. On CPU pass ``torch_dtype="fp32"``: the bf16 default suits GPUs.
    ``chat=True`` requires a chat template; ``pad_token``/``eos_token`` override the tokenizer's choices.
    A vision-language model (Qwen2-VL, Qwen2.5-VL) loads as an image-text-to-text model with its processor,
    checked against the model and tokenizer too (`verl.models.vision_checks`); ``return_processor=True``
    returns ``(model, tokenizer, processor)`` (processor None for a text model; also ``report.processor``).
    """
    model, tokenizer, report = load_hf_model_with_report(
        model_name, tokenizer_name=tokenizer_name, use_flash_attention_2=use_flash_attention_2,
        attn_implementation=attn_implementation, torch_dtype=torch_dtype, trust_remote_code=trust_remote_code,
        device=device, revision=revision, for_training=for_training, chat=chat, pad_token=pad_token,
        eos_token=eos_token)
    report.raise_if_problems()
    return (model, tokenizer, report.processor) if return_processor else (model, tokenizer)


__all__ = [
    "CONFIG_KEYS",
    "load_hf_model",
    "load_hf_model_with_report",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_attn_implementation",
    "check_remote_code",
    "quiet_hf_console",
    "quiet_hf_progress",
    "LoadReport",
]
