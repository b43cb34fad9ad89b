"""What every tiny local model shares: the byte-level BPE tokenizer trained with Qwen2's exact pipeline, the
parameters that key the on-disk cache, and the build-in-a-temp-folder-then-rename that makes concurrent builders
safe. `verl.models.tiny` builds the text models on it, `verl.models.tiny_vl` the vision-language ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl.errors import ModelError

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


def save_model(model: Any, directory: Path) -> None:
    """`model.save_pretrained(directory)` on any rank, checked. transformers >= 5 writes no config or weights on a
    rank other than 0 of an initialized process group, but every rank may be the one whose build wins the rename
    (and each node has a cache of its own): this throwaway model saves wherever it is built."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this instance only: it is saved and dropped
    model.save_pretrained(str(directory))
    if not _has_model_files(directory):
        raise ModelError(f"tiny model build at {directory}: transformers' save_pretrained wrote no config.json and "
                         "*.safetensors weights. Please report it with `pip show transformers torch`.")


def _has_model_files(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _marked(directory: Path, params: dict[str, Any]) -> bool:
    marker = directory / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == params
    except (OSError, ValueError):
        return False


def _is_complete(directory: Path, params: dict[str, Any]) -> bool:
    return _marked(directory, params) and _has_model_files(directory)


def _build(params: dict[str, Any], path: str | os.PathLike | None,
           write: Callable[[dict[str, Any], Path], None]) -> str:
    """The folder of the model `params` describe: the cached one, or one `write(params, folder)` fills in a temp
    folder that is renamed into place when complete (`write` writes MARKER_FILE last)."""
    target = Path(path) if path is not None else _cache_root() / _cache_key(params)
    target = target.expanduser().resolve()
    if _is_complete(target, params):
        return str(target)
    if path is None and _marked(target, params):  # a cache entry marked without its weights (built on a rank that
        shutil.rmtree(target, ignore_errors=True)  # transformers would not let save, before `save_model`): rebuilt
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelError(
            f"build_tiny_model: {target} already exists and is not a tiny model built with these parameters "
            f"({MARKER_FILE} missing or different, or no config.json and weights). Pass another path, delete the "
            "directory, or pass path=None to use the cache ($VERL_CACHE_DIR/tiny).")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir, then rename: a concurrent builder either wins the rename or finds the
    # finished directory, and nobody ever sees a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-",
                                dir=target.parent))
    try:
        write(params, tmp)
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
