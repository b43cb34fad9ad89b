"""Tiny local models: tokenizer coverage, reload round trip, determinism, cache and atomic builds."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.errors import ConfigError, ModelError
from verl.models import tiny
from verl.models.tiny import SAMPLE_STRINGS, build_tiny_model


def test_digits_and_words_are_single_tokens(instruct_path):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    for d in "0123456789":
        assert len(tok.encode(d, add_special_tokens=False)) == 1
    # Numbers split into one token per digit, like Qwen.
    pieces = tok.convert_ids_to_tokens(tok.encode("What is 12+7? The answer is 19.", add_special_tokens=False))
    assert pieces == ["What", "Ġis", "Ġ", "1", "2", "+", "7", "?", "ĠThe", "Ġanswer", "Ġis", "Ġ", "1", "9", "."]
    for word in ("what", "is", "the", "answer", "plus", "minus", "times", "equals", "helpful", "assistant"):
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    for op in "+-*=?":
        assert len(tok.encode(op, add_special_tokens=False)) == 1, op
    assert 300 <= len(tok) <= 1024


@pytest.mark.parametrize("fixture", ["instruct_path", "base_path", "llama_path"])
def test_reload_encodes_identically_and_decodes_back(fixture, request):
    path = request.getfixturevalue(fixture)
    params = json.loads((Path(path) / tiny.MARKER_FILE).read_text())
    built = tiny._build_tokenizer(params["arch"], params["variant"], params["vocab_size"])
    reloaded = AutoTokenizer.from_pretrained(path)
    assert len(built) == len(reloaded)
    for text in SAMPLE_STRINGS + ["<|endoftext|> after", "x" * 50]:
        ids = built.encode(text, add_special_tokens=False)
        assert reloaded.encode(text, add_special_tokens=False) == ids
        assert reloaded.decode(ids) == text


def test_variants_share_text_ids_and_differ_in_chat_tokens(instruct_path, base_path):
    inst = AutoTokenizer.from_pretrained(instruct_path)
    base = AutoTokenizer.from_pretrained(base_path)
    for text in SAMPLE_STRINGS:
        assert inst.encode(text) == base.encode(text)
    assert inst.chat_template and not base.chat_template
    assert inst.eos_token == "<|im_end|>" and base.eos_token == "<|endoftext|>"
    assert len(inst.encode("<|im_start|>", add_special_tokens=False)) == 1
    assert len(base.encode("<|im_start|>", add_special_tokens=False)) > 1
    assert len(base) == len(inst) - 2
    rendered = inst.apply_chat_template([{"role": "user", "content": "What is 1+1?"}], tokenize=False,
                                        add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"


def test_model_size_and_config(instruct_path, llama_path):
    model = AutoModelForCausalLM.from_pretrained(instruct_path, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(instruct_path)
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]
    llama = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    assert type(llama).__name__ == "LlamaForCausalLM"
    ltok = AutoTokenizer.from_pretrained(llama_path)
    assert ltok.bos_token == "<|begin_of_text|>"
    assert ltok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|begin_of_text|><|im_start|>user")


def test_build_is_deterministic_and_seeded(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3, hidden_size=32, num_layers=1)
    b = build_tiny_model(tmp_path / "b", seed=3, hidden_size=32, num_layers=1)
    c = build_tiny_model(tmp_path / "c", seed=4, hidden_size=32, num_layers=1)
    wa, wb, wc = (load_file(str(Path(p) / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (Path(a) / "tokenizer.json").read_text() == (Path(b) / "tokenizer.json").read_text()
    # Building does not disturb the caller's random stream.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "d", seed=5, hidden_size=32, num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_cache_dir_key_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    p1 = build_tiny_model(hidden_size=32, num_layers=1)
    assert Path(p1).parent == tmp_path / "cache" / "tiny"
    assert "qwen2-instruct-h32-l1-s0" in Path(p1).name
    stamp = (Path(p1) / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(hidden_size=32, num_layers=1) == p1
    assert (Path(p1) / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    p2 = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert p2 != p1
    marker = json.loads((Path(p1) / tiny.MARKER_FILE).read_text())
    assert marker["format_version"] == tiny.TINY_FORMAT_VERSION and marker["hidden_size"] == 32


def test_concurrent_builders_get_one_complete_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    results: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, seed=9))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    entries = [p.name for p in (tmp_path / "tiny").iterdir()]
    assert entries == [Path(results[0]).name]  # no temp directories left behind
    AutoModelForCausalLM.from_pretrained(results[0])


def test_a_build_on_rank_one_of_a_process_group_writes_the_weights(tmp_path, monkeypatch):
    """transformers >= 5 saves a model only on rank 0 of an initialized process group; the tiny model is built by
    whichever rank's build wins (and each node has a cache of its own), so its files cannot depend on the rank."""
    small = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    on_rank_one = Path(build_tiny_model(tmp_path / "rank1", **small))
    monkeypatch.undo()
    assert (on_rank_one / "config.json").is_file() and (on_rank_one / "model.safetensors").is_file()
    built = AutoModelForCausalLM.from_pretrained(on_rank_one).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "rank0", **small)).state_dict()
    assert built.keys() == reference.keys() and all(torch.equal(built[k], reference[k]) for k in built)


def test_a_cache_entry_marked_complete_without_its_weights_is_rebuilt(tmp_path, monkeypatch):
    """What a rank-1 build left in the cache before: the tokenizer and the marker, no config or weights."""
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    small = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, seed=5)
    path = Path(build_tiny_model(**small))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).unlink()
    assert build_tiny_model(**small) == str(path)
    AutoModelForCausalLM.from_pretrained(path)
    # A folder the user named is never deleted: it is refused, saying what is missing.
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no config.json and weights"):
        build_tiny_model(path, **small)
    assert (path / "config.json").is_file()


def test_existing_foreign_directory_is_refused(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="already exists and is not a tiny model.*Pass another path"):
        build_tiny_model(target)
    assert (target / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2' is not supported; use one of qwen2, llama"),
        ({"variant": "chat"}, "variant='chat' is not supported"),
        ({"hidden_size": 60, "num_heads": 8}, "not divisible by num_heads=8"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads to divide num_heads"),
        ({"vocab_size": 100}, "vocab_size=100 must be between 300 and 8192"),
        ({"num_layers": 0}, "num_layers=0 must be a positive integer"),
    ],
)
def test_invalid_parameters(kwargs, message, tmp_path):
    with pytest.raises(ModelError, match=message):
        build_tiny_model(tmp_path / "x", **kwargs)


def test_the_tools_variant_writes_tool_calls_in_few_tokens_and_keeps_their_tags():
    """`tiny:...:tools`: the Hermes template and tags (kept in decoded text, for the parser), JSON merges."""
    from transformers import AutoTokenizer

    from verl.data.tool_parsers import ToolCall, format_hermes, parse_hermes
    from verl.models.tiny import TOOL_TAGS, build_from_spec
    from verl.utils.chat_render import HERMES_TEMPLATE

    tok = AutoTokenizer.from_pretrained(build_from_spec("tiny:qwen2:64:2:tools"))
    assert tok.chat_template == HERMES_TEMPLATE and tok.eos_token == "<|im_end|>"
    call = format_hermes([ToolCall("calculator", {"expression": "347*29"})])
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert len(ids) < 30 and tok.convert_ids_to_tokens(ids[0]) == "<tool_call>"
    assert parse_hermes(tok.decode(ids, skip_special_tokens=True)).calls == [ToolCall("calculator",
                                                                                       {"expression": "347*29"})]
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in TOOL_TAGS)
    with pytest.raises(ConfigError, match="variant 'tool' is not one of instruct, base, tools"):
        build_from_spec("tiny:qwen2:64:2:tool")


def test_a_spec_sets_build_options_by_name(tmp_path, monkeypatch):
    """`tiny:...:name=value` reaches the built config (the agent demo's rope_theta=100); a wrong name or value
    is a ConfigError naming the key and the options."""
    from transformers import AutoConfig

    from verl.models.tiny import build_from_spec

    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    config = AutoConfig.from_pretrained(build_from_spec("tiny:qwen2:64:2:tools:rope_theta=100:num_heads=8"))
    theta = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert theta["rope_theta"] == 100.0 and config.num_attention_heads == 8
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2
    default = AutoConfig.from_pretrained(build_from_spec("tiny:qwen2:64:2:tools"))
    assert (getattr(default, "rope_parameters", None) or {"rope_theta": default.rope_theta})["rope_theta"] == 10000.0
    for spec, message in (("tiny:qwen2:64:2:rope=100", "unknown option 'rope'"),
                          ("tiny:qwen2:64:2:rope_theta=abc", "rope_theta='abc' is not a float"),
                          ("tiny:qwen2:64:2:rope_theta=inf", "rope_theta=inf must be a finite number above 1"),
                          ("tiny:qwen2:64:2:num_heads=3", "model.path='tiny:qwen2:64:2:num_heads=3': build_tiny")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_from_spec(spec)
