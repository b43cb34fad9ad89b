"""Tiny local models for tests and the demo.

Tests and the demo must not need a model hub, so we build a Qwen2- or Llama-architecture model and a
byte-level BPE tokenizer locally, deterministically from a seed, in well under a second. The tokenizer is
trained on arithmetic and plain English ("What is 12+7? The answer is 19."): every digit is its own token
(numbers are split into single digits, as Qwen does), so the arithmetic demo can learn digit by digit.

A third, ``"tools"``, is instruct with the Hermes tool format (`TOOL_TAGS`, `HERMES_TEMPLATE`) for the
tool and agent demos. Two variants reproduce the classic instruct/base mix-up: ``"instruct"`` has the ChatML special
tokens ``<|im_start|>``/``<|im_end|>`` and a chat template, ``"base"`` has neither. Both share the same ids for
ordinary text, as a real base/instruct pair does.

The tokenizer is trained with exactly the pipeline transformers 5.x rebuilds for ``model_type="qwen2"``
(NFC normaliser, Qwen2's split regex, ByteLevel without its own regex): ``AutoTokenizer`` re-creates the
backend from vocab/merges with that pipeline, so any other pipeline would change ids on reload. Every
build checks that the saved tokenizer reloads with identical ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from verl.errors import ModelError
from verl.models.tiny_base import (  # noqa: F401 - re-exported: tests and callers import them from here
    ARCHS,
    BEGIN_OF_TEXT,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MARKER_FILE,
    QWEN2_SPLIT_REGEX,
    SAMPLE_STRINGS,
    TINY_FORMAT_VERSION,
    TOOL_TAGS,
    VARIANTS,
    _build,
    _params,
    _train_backend,
    _validate,
    _verify_tokenizer_roundtrip,
    save_model,
)
from verl.models.tiny_vl import VL_ARCHS, build_tiny_vl_model
from verl.utils.chat_render import HERMES_TEMPLATE

CHATML_TEMPLATE = (
    "{%- if bos_token is defined and bos_token %}{{ bos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _special_tokens(arch: str, variant: str) -> list[str]:
    # The base variant is a prefix of the instruct one, so ordinary text and <|endoftext|> share ids.
    tokens = [ENDOFTEXT]
    if arch == "llama":
        tokens.append(BEGIN_OF_TEXT)
    if variant in ("instruct", "tools"):
        tokens += [IM_START, IM_END]
    return tokens


def _build_tokenizer(arch: str, variant: str, vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    # Both variants train the same BPE (sized for the instruct specials), so the base vocabulary is an exact
    # prefix of the instruct one, as with a real base/instruct pair.
    bpe_size = vocab_size - len(_special_tokens(arch, "instruct")) - (len(TOOL_TAGS) if variant == "tools" else 0)
    backend = _train_backend(bpe_size, _special_tokens(arch, variant), variant)
    chat = variant in ("instruct", "tools")
    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "eos_token": IM_END if chat else ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "bos_token": BEGIN_OF_TEXT if arch == "llama" else None,
        "model_max_length": 32768,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    if chat:
        kwargs["additional_special_tokens"] = [IM_START, IM_END]
    tokenizer = PreTrainedTokenizerFast(**kwargs)
    if chat:
        tokenizer.chat_template = HERMES_TEMPLATE if variant == "tools" else CHATML_TEMPLATE
    return tokenizer


def _model_config(params: dict[str, Any], tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        rope_theta=params["rope_theta"],
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if params["arch"] == "qwen2":
        config = Qwen2Config(**common)
    else:
        config = LlamaConfig(**common)
    if params["kind"] == "reward":
        config.num_labels = 1
    return config


def _generation_eos(tokenizer, variant: str) -> int | list[int]:
    if variant in ("instruct", "tools"):
        # Like Qwen2.5-Instruct: the chat turn end and the document end both stop generation.
        return [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    return tokenizer.convert_tokens_to_ids(ENDOFTEXT)


def _write(params: dict[str, Any], directory: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    tokenizer = _build_tokenizer(params["arch"], params["variant"], params["vocab_size"])
    config = _model_config(params, tokenizer)
    auto = AutoModelForSequenceClassification if params["kind"] == "reward" else AutoModelForCausalLM
    # Fork the RNG so building a model never disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = auto.from_config(config, dtype=torch.float32)
    if params["kind"] == "causal_lm":
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=_generation_eos(tokenizer, params["variant"]),
            pad_token_id=tokenizer.pad_token_id,
        )
    from verl.models.hf_loader import quiet_hf_progress

    with quiet_hf_progress():
        save_model(model, directory)
        tokenizer.save_pretrained(str(directory))
    _verify_tokenizer_roundtrip(tokenizer, directory)
    # The marker goes in last: a directory with the marker is complete.
    (directory / MARKER_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    path: str | os.PathLike | None = None,
    *,
    arch: str = "qwen2",
    variant: str = "instruct",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 768,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
) -> str:
    """Build (or reuse from the cache) a tiny causal LM + tokenizer and return its directory.

    With ``path=None`` the model lives under ``$VERL_CACHE_DIR/tiny/<key>`` (default ``~/.cache/verl``),
    where the key covers every parameter and the format version, so the same call returns the same files.
    The directory loads with ``AutoModelForCausalLM``/``AutoTokenizer`` and with ``load_hf_model``.
    """
    intermediate = intermediate_size if intermediate_size is not None else 4 * hidden_size
    _validate(arch, variant, hidden_size, num_layers, num_heads, num_kv_heads, intermediate, vocab_size, rope_theta)
    params = _params("causal_lm", arch, variant, seed, hidden_size, num_layers, num_heads, num_kv_heads,
                     intermediate, vocab_size, max_position_embeddings, rope_theta)
    return _build(params, path, _write)


def build_tiny_reward_model(
    path: str | os.PathLike | None = None,
    *,
    arch: str = "qwen2",
    variant: str = "instruct",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 768,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
) -> str:
    """Like :func:`build_tiny_model` but an ``AutoModelForSequenceClassification`` with one label.

    It stands in for a learned reward model in tests of reward-model scoring and PPO with a reward model.
    """
    intermediate = intermediate_size if intermediate_size is not None else 4 * hidden_size
    _validate(arch, variant, hidden_size, num_layers, num_heads, num_kv_heads, intermediate, vocab_size, rope_theta)
    params = _params("reward", arch, variant, seed, hidden_size, num_layers, num_heads, num_kv_heads,
                     intermediate, vocab_size, max_position_embeddings, rope_theta)
    return _build(params, path, _write)


def is_tiny_spec(path: str | os.PathLike | None) -> bool:
    """`tiny` or `tiny:...`: a model built here instead of read from a folder or the hub."""
    return isinstance(path, str) and (path == "tiny" or path.startswith("tiny:"))


SPEC_OPTIONS = {"rope_theta": float, "num_heads": int, "num_kv_heads": int, "intermediate_size": int}


def build_from_spec(spec: str, *, key: str = "model.path", reward: bool = False) -> str:
    """The folder of the tiny model `tiny[:arch[:hidden[:layers[:variant]]]][:name=value...]` names (arch
    `qwen2_5_vl`/`qwen2_vl`: a vision-language model with its processor, `verl.models.tiny_vl`), so every
    config key that takes a model path (policy, reference, critic, reward model) accepts the same offline
    stand-in; `name=value` parts set a `SPEC_OPTIONS` build argument (`tiny:qwen2:64:2:tools:rope_theta=100`);
    `reward=True` builds it with a one-label sequence-classification head, which a reward model needs."""
    from verl.errors import ConfigError

    usage = ("expected tiny[:arch[:hidden_size[:num_layers[:variant]]]][:name=value...], e.g. tiny:qwen2:128:2, "
             f"tiny:qwen2:64:2:tools:rope_theta=100 or tiny:qwen2_5_vl (names: {', '.join(SPEC_OPTIONS)})")
    parts = [p for p in spec.split(":")[1:] if "=" not in p]
    kwargs: dict[str, Any] = {}
    for option in (p for p in spec.split(":")[1:] if "=" in p):
        name, _, value = option.partition("=")
        if name not in SPEC_OPTIONS:
            raise ConfigError(f"{key}={spec!r}: unknown option {name!r}; {usage}")
        try:
            kwargs[name] = SPEC_OPTIONS[name](value)
        except ValueError:
            raise ConfigError(f"{key}={spec!r}: {name}={value!r} is not a {SPEC_OPTIONS[name].__name__}; "
                              f"{usage}") from None
    try:
        sizes = [int(p) for p in parts[1:3]]
    except ValueError:
        raise ConfigError(f"{key}={spec!r}: {usage}") from None
    kwargs |= dict(zip(("hidden_size", "num_layers"), sizes, strict=False))
    if len(parts) > 3:
        if parts[3] not in VARIANTS:
            raise ConfigError(f"{key}={spec!r}: variant {parts[3]!r} is not one of {', '.join(VARIANTS)}")
        kwargs["variant"] = parts[3]
    build = build_tiny_reward_model if reward else build_tiny_model
    if parts and parts[0] in VL_ARCHS:
        if reward or len(parts) > 3:
            raise ConfigError(f"{key}={spec!r}: a tiny vision-language model takes no variant and has no reward "
                              f"head; use tiny:{parts[0]}[:hidden_size[:num_layers]]")
        build = build_tiny_vl_model
    try:
        return build(arch=parts[0] if parts else "qwen2", seed=0, **kwargs)
    except ModelError as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None


__all__ = [
    "build_from_spec",
    "build_tiny_model",
    "build_tiny_reward_model",
    "is_tiny_spec",
    "SAMPLE_STRINGS",
    "CHATML_TEMPLATE",
    "ENDOFTEXT",
    "IM_START",
    "IM_END",
    "BEGIN_OF_TEXT",
    "TINY_FORMAT_VERSION",
]
