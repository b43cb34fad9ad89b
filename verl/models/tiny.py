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

import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from verl.errors import ModelError
from verl.utils.chat_render import HERMES_TEMPLATE

# Bump when anything that changes the files on disk changes; it is part of the cache key.
TINY_FORMAT_VERSION = 2

MARKER_FILE = "verl_tiny.json"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BEGIN_OF_TEXT = "<|begin_of_text|>"

# Qwen2's pre-tokenizer split regex (the one transformers' Qwen2Tokenizer uses). Note ``\p{N}`` matches a
# single digit, which is what splits numbers into digits.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{%- if bos_token is defined and bos_token %}{{ bos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHS = ("qwen2", "llama")
VARIANTS = ("instruct", "base", "tools")
# The `tools` variant: instruct, plus the Hermes tool tags as tokens (kept in decoded text, as Qwen2.5 keeps
# them) and BPE merges for the OpenAI function format's JSON, so that a tool schema and a call are a few
# dozen tokens instead of one per character; its chat template is HERMES_TEMPLATE.
TOOL_TAGS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_WORDS = """
what is the answer plus minus times divided by equals equal sum difference product of and to a an in
that it for you your we are was were be been this these those there their they he she his her with as
on at from or not no yes if then else so because how many much more less than number numbers digit
digits add added subtract take away multiply multiplied result total zero one two three four five six
seven eight nine ten eleven twelve hundred thousand question questions solve problem step steps first
second next last final think let us compute calculate check correct wrong right good bad please give
me only just write show work explain why when where who which can could would should will do does did
make made have has had get got say said see know tell find use used each every all some any other
new old big small left right up down over under after before again here now today time day people
system user assistant helpful you are a helpful assistant hello hi thanks thank okay sure great
""".split()

_SENTENCES = [
    "You are a helpful assistant.",
    "Let's think step by step.",
    "The answer is",
    "Please give only the final answer.",
    "Solve the problem and write the result.",
    "How many are there in total?",
    "Hello! How can I help you today?",
]


def _tool_corpus() -> list[str]:
    """Tool schemas and calls in the OpenAI function format, as the Hermes template renders them."""
    lines = []
    for name, arg, desc in (("calculator", "expression", "Multiply integers: a*b."), ("search", "query", "Search."),
                            ("python", "code", "Run code."), ("weather", "city", "The weather in a city.")):
        schema = {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
        lines += [json.dumps(schema)] * 8
        for a in range(10, 400, 7):
            lines.append(json.dumps({"name": name, "arguments": {arg: f"{a}*{a % 90 + 10}"}}))
    return lines


def _training_corpus(variant: str = "instruct") -> list[str]:
    """A fixed corpus: arithmetic questions in several phrasings plus common words and sentences (and, for the
    `tools` variant, tool schemas and calls)."""
    lines: list[str] = _tool_corpus() if variant == "tools" else []
    for a in range(0, 40, 3):
        for b in range(0, 30, 4):
            lines.append(f"What is {a}+{b}? The answer is {a + b}.")
            lines.append(f"What is {a} plus {b}? {a} + {b} = {a + b}")
            lines.append(f"What is {a}-{b}? The answer is {a - b}.")
            lines.append(f"What is {a} minus {b}? {a} - {b} = {a - b}")
            lines.append(f"What is {a}*{b}? The answer is {a * b}.")
            lines.append(f"What is {a} times {b}? {a} * {b} = {a * b}")
    # Words appear mid-sentence (" what") far more often than capitalised at the start ("What"), so the
    # lower-case forms with a leading space are repeated most.
    for _ in range(24):
        lines.append(" " + " ".join(_WORDS))
        lines.extend(_SENTENCES)
    for _ in range(6):
        lines.append(" ".join(w.capitalize() for w in _WORDS))
    return lines


# Strings every reload must encode identically (and decode back to themselves).
SAMPLE_STRINGS = [
    "What is 12+7?",
    "19",
    "The answer is 19.",
    "What is 345 minus 67? 345 - 67 = 278",
    "What is 6 times 7? The answer is 42.",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\nline four",
    "Unicode: café naïve — 東京 ✓",
    "Numbers 0123456789 and 3.14, -5, 1e3",
    "What's the sum? It's 10, isn't it?",
    "You are a helpful assistant.",
]


def _cache_root() -> Path:
    return Path(os.environ.get("VERL_CACHE_DIR") or Path.home() / ".cache" / "verl") / "tiny"


def _params(kind: str, arch: str, variant: str, seed: int, hidden_size: int, num_layers: int,
            num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
            max_position_embeddings: int, rope_theta: float) -> dict[str, Any]:
    return {
        "format_version": TINY_FORMAT_VERSION,
        "kind": kind,
        "arch": arch,
        "variant": variant,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": float(rope_theta),
    }


def _cache_key(params: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return (f"{params['kind']}-{params['arch']}-{params['variant']}-h{params['hidden_size']}"
            f"-l{params['num_layers']}-s{params['seed']}-{digest}")


def _validate(arch: str, variant: str, hidden_size: int, num_layers: int, num_heads: int,
              num_kv_heads: int, intermediate_size: int, vocab_size: int, rope_theta: float) -> None:
    where = "build_tiny_model"
    if arch not in ARCHS:
        raise ModelError(f"{where}: arch={arch!r} is not supported; use one of {', '.join(ARCHS)}.")
    if variant not in VARIANTS:
        raise ModelError(f"{where}: variant={variant!r} is not supported; use one of {', '.join(VARIANTS)}.")
    for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ModelError(f"{where}: {name}={value} must be a positive integer.")
    if hidden_size % num_heads != 0:
        raise ModelError(f"{where}: hidden_size={hidden_size} is not divisible by num_heads={num_heads}; "
                         f"pick num_heads that divides hidden_size (e.g. {_divisor_hint(hidden_size)}).")
    if num_heads % num_kv_heads != 0:
        raise ModelError(f"{where}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}; "
                         "grouped-query attention needs num_kv_heads to divide num_heads.")
    if (hidden_size // num_heads) % 2 != 0:
        raise ModelError(f"{where}: head dim hidden_size/num_heads={hidden_size // num_heads} is odd; rotary "
                         "embeddings need an even head dim, change hidden_size or num_heads.")
    if not (math.isfinite(rope_theta) and rope_theta > 1):
        raise ModelError(f"{where}: rope_theta={rope_theta} must be a finite number above 1 (the rotary base; "
                         "10000 is the usual, ~100 resolves the short distances of a tiny model's contexts).")
    if not 300 <= vocab_size <= 8192:
        raise ModelError(f"{where}: vocab_size={vocab_size} must be between 300 and 8192 (256 byte tokens "
                         "plus merges); the default 768 makes every common English word one token.")


def _divisor_hint(n: int) -> int:
    for d in (4, 2, 1):
        if n % d == 0:
            return d
    return 1


def _train_backend(bpe_size: int, special_tokens: list[str], variant: str = "instruct"):
    """Train the byte-level BPE with Qwen2's exact pipeline; special tokens get the ids after the merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(variant), trainer)
    tok.add_special_tokens(special_tokens)
    if variant == "tools":
        tok.add_tokens(TOOL_TAGS)  # ordinary added tokens: decoded text keeps them, as the parser needs
    return tok


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


def _verify_tokenizer_roundtrip(built, directory: Path) -> None:
    """Reload with AutoTokenizer (the way every user will load it) and demand identical ids."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(directory))
    samples = list(SAMPLE_STRINGS)
    if built.chat_template:
        samples.append(built.apply_chat_template(
            [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "19"}],
            tokenize=False))
    for text in samples:
        a = built(text, add_special_tokens=True)["input_ids"]
        b = reloaded(text, add_special_tokens=True)["input_ids"]
        if a != b:
            raise ModelError(
                f"tiny model build at {directory}: the saved tokenizer encodes {text!r} as {b} after reload but "
                f"as {a} when built. This is a bug in verl.models.tiny for transformers versions that rebuild "
                "the tokenizer pipeline; please report it with `pip show transformers tokenizers`.")
        if reloaded.decode(b) != text:
            raise ModelError(
                f"tiny model build at {directory}: decode(encode({text!r})) gave {reloaded.decode(b)!r}; the "
                "byte-level round trip is broken. Please report it with `pip show transformers tokenizers`.")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(built, name) != getattr(reloaded, name):
            raise ModelError(f"tiny model build at {directory}: {name} is {getattr(reloaded, name)} after reload "
                             f"but {getattr(built, name)} when built; please report it.")
    if len(built) != len(reloaded):
        raise ModelError(f"tiny model build at {directory}: the tokenizer has {len(reloaded)} tokens after reload "
                         f"but {len(built)} when built (a default special token was added); please report it.")


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
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
    _verify_tokenizer_roundtrip(tokenizer, directory)
    # The marker goes in last: a directory with the marker is complete.
    (directory / MARKER_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def _is_complete(directory: Path, params: dict[str, Any]) -> bool:
    marker = directory / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == params
    except (OSError, ValueError):
        return False


def _build(params: dict[str, Any], path: str | os.PathLike | None, write: Any = None) -> str:
    """The folder of the model `params` describe: the cached one, or one `write(params, folder)` fills (default
    `_write`, the text models) in a temp folder renamed into place when complete."""
    target = Path(path) if path is not None else _cache_root() / _cache_key(params)
    target = target.expanduser().resolve()
    if _is_complete(target, params):
        return str(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelError(
            f"build_tiny_model: {target} already exists and is not a tiny model built with these parameters "
            f"({MARKER_FILE} missing or different). Pass another path, delete the directory, or pass path=None "
            "to use the cache ($VERL_CACHE_DIR/tiny).")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir, then rename: a concurrent builder either wins the rename or finds the
    # finished directory, and nobody ever sees a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-",
                                dir=target.parent))
    try:
        (write or _write)(params, tmp)
        # rename() replaces an empty directory and fails on a non-empty one (another builder won).
        os.rename(tmp, target)
    except OSError:
        if _is_complete(target, params):
            return str(target)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


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
    return _build(params, path)


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
    return _build(params, path)


def is_tiny_spec(path: str | os.PathLike | None) -> bool:
    """`tiny` or `tiny:...`: a model built here instead of read from a folder or the hub."""
    return isinstance(path, str) and (path == "tiny" or path.startswith("tiny:"))


SPEC_OPTIONS = {"rope_theta": float, "num_heads": int, "num_kv_heads": int, "intermediate_size": int}


def _vl_archs() -> tuple[str, ...]:
    from verl.models.tiny_vl import VL_ARCHS

    return VL_ARCHS


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
    if parts and parts[0] in _vl_archs():
        from verl.models.tiny_vl import build_tiny_vl_model

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
