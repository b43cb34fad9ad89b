"""load_hf_model: each classic model/tokenizer failure is caught at load time with a message naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from verl.errors import ConfigError, ModelError
from verl.models import hf_loader
from verl.models.checks import check_model_and_tokenizer
from verl.models.hf_loader import load_hf_model, load_hf_model_with_report, resolve_attn_implementation
from verl.models.tiny import build_tiny_model
from verl.utils.dtype import check_dtype_for_device, dtype_name, resolve_dtype


def load(path, **kwargs):
    return load_hf_model(path, torch_dtype="fp32", **kwargs)


def test_happy_path_report(instruct_path):
    model, tok = load(instruct_path, for_training=False, chat=True)
    report = model.verl_load_report
    assert report.ok and report.problems == []
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert report.stop_token_ids == [im_end, eot]
    assert report.dtype == "fp32" and next(model.parameters()).dtype == torch.float32
    assert report.attn_implementation == "sdpa"
    assert report.num_parameters == sum(p.numel() for p in model.parameters())
    assert report.num_trainable_parameters == 0 and not model.training  # for_training=False
    assert report.embedding_rows == len(tok) == report.tokenizer_size
    assert report.chat_template == "present, probe ok"
    table = {t.role: (t.token, t.id) for t in report.special_tokens}
    assert table["eos"] == ("<|im_end|>", im_end) and table["pad"] == ("<|endoftext|>", eot)
    assert table["bos"] == (None, None)
    text = report.format()
    assert "stop token ids" in text and "<|im_end|>" in text and instruct_path in text


def test_training_mode_and_explicit_attention(llama_path):
    model, tok = load(llama_path, attn_implementation="eager", chat=True)
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert model.verl_load_report.attn_implementation == "eager"
    assert model.verl_load_report.special_tokens[-2].token == "<|begin_of_text|>"


def test_instruct_model_with_base_tokenizer(instruct_path, base_path):
    with pytest.raises(ModelError) as info:
        load(instruct_path, tokenizer_name=base_path)
    msg = str(info.value)
    assert instruct_path in msg and base_path in msg
    assert "'<|im_start|>' -> ['<', '|'" in msg
    assert "drop tokenizer_name" in msg
    with pytest.raises(ModelError, match="chat formatting is on but tokenizer .* has no chat template"):
        load(instruct_path, tokenizer_name=base_path, chat=True)


def test_compatible_tokenizer_from_another_directory_is_allowed(instruct_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    tok.save_pretrained(tmp_path / "tok")
    model, tok2 = load(instruct_path, tokenizer_name=str(tmp_path / "tok"))
    assert model.verl_load_report.tokenizer_source == str(tmp_path / "tok")
    assert len(tok2) == len(tok)


def test_base_model_with_instruct_tokenizer_ids_out_of_range(instruct_path, base_path):
    with pytest.raises(ModelError) as info:
        load(base_path, tokenizer_name=instruct_path)
    msg = str(info.value)
    rows = len(AutoTokenizer.from_pretrained(base_path))
    assert f"embedding matrix has only {rows} rows" in msg
    assert "'<|im_end|>'" in msg and "resize_token_embeddings" in msg
    assert base_path in msg and instruct_path in msg


def test_vocabulary_mismatch_names_both_sources(instruct_path):
    other = build_tiny_model(vocab_size=300)  # same architecture, far fewer merges
    with pytest.raises(ModelError) as info:
        load(instruct_path, tokenizer_name=other, chat=False)
    msg = str(info.value)
    assert "the vocabularies differ" in msg and other in msg and instruct_path in msg


def test_pad_none_is_set_to_eos_with_warning(instruct_path, edited_copy):
    path = edited_copy(instruct_path, "tokenizer_config.json", pad_token=None)
    assert AutoTokenizer.from_pretrained(path).pad_token is None
    model, tok = load(path)
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.eos_token_id == model.generation_config.pad_token_id
    report = model.verl_load_report
    assert any("no pad token; using eos '<|im_end|>'" in w and "pad_token=" in w for w in report.warnings)
    assert [t.note for t in report.special_tokens if t.role == "pad"] == ["was None, set to eos"]
    # An explicit pad token wins; one the vocabulary lacks is an error.
    _, tok = load(path, pad_token="<|endoftext|>")
    assert tok.pad_token == "<|endoftext|>"
    with pytest.raises(ModelError, match=r"pad_token='<pad>' is not a single token .* Fix: pass a token"):
        load(path, pad_token="<pad>")


def test_pad_and_eos_both_missing(instruct_path):
    model, tok = load(instruct_path)
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    tok.pad_token = None
    tok.eos_token = None
    report = check_model_and_tokenizer(model, tok, model_source="m")
    assert not report.ok
    text = "\n".join(report.problems)
    assert "generation would never stop" in text and "eos_token=" in text
    assert "no pad token and no eos token" in text and "pad_token='<a token of the vocabulary>'" in text
    with pytest.raises(ModelError, match="failed 2 load-time check"):
        report.raise_if_problems()


def test_eos_mismatch_between_tokenizer_and_generation_config(instruct_path, edited_copy):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    path = edited_copy(instruct_path, "generation_config.json", eos_token_id=eot)
    # Tokenizer eos is <|im_end|>, the model stops on <|endoftext|> only.
    with pytest.raises(ModelError) as info:
        load(path)
    msg = str(info.value)
    assert "eos mismatch" in msg and "'<|im_end|>'" in msg and f"[{eot}]" in msg
    assert "eos_token='<|endoftext|>'" in msg  # the fix
    model, tok2 = load(path, eos_token="<|endoftext|>")
    assert tok2.eos_token == "<|endoftext|>" and model.verl_load_report.stop_token_ids == [eot]


def test_generation_eos_list_is_reconciled(base_path, instruct_path):
    # The base tokenizer's eos (<|endoftext|>) is one of the instruct model's stop ids: fine, reported.
    model, tok = load(base_path)
    assert model.verl_load_report.stop_token_ids == [tok.eos_token_id]
    model, tok = load(instruct_path)
    assert model.generation_config.eos_token_id == model.verl_load_report.stop_token_ids


def test_generation_eos_out_of_range(instruct_path, edited_copy):
    path = edited_copy(instruct_path, "generation_config.json", eos_token_id=[5000])
    with pytest.raises(ModelError, match=r"generation_config.eos_token_id 5000 is >= the 768 embedding rows"):
        load(path, eos_token="<|im_end|>")


def test_chat_template_with_unknown_marker(instruct_path):
    model, tok = load(instruct_path)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}<|im_end|>{% endfor %}")
    report = check_model_and_tokenizer(model, tok, model_source="m", chat=True)
    assert report.chat_template == "present, probe FAILED"
    assert any("'<|user|>' -> ['<', '|'" in p and "Fix:" in p for p in report.problems)
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    report = check_model_and_tokenizer(model, tok, model_source="m")
    assert any("failed to render a probe conversation" in p for p in report.problems)


def test_chat_required_without_template(base_path):
    with pytest.raises(ModelError, match=r"no chat template .* Fix: use the instruct/chat model's tokenizer"):
        load(base_path, chat=True)
    model, _ = load(base_path)  # chat not requested: fine
    assert model.verl_load_report.chat_template == "absent"


def test_flash_attention_without_package_or_cuda(instruct_path, monkeypatch):
    monkeypatch.setattr(hf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r'flash_attn package is not installed. Fix: use attn_implementation="sdpa"'):
        load(instruct_path, use_flash_attention_2=True)
    # Installed but no CUDA (this CPU machine): still refused, naming the alternative.
    monkeypatch.setattr(hf_loader.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ModelError, match=r'only runs on CUDA GPUs .* use attn_implementation="sdpa"'):
        resolve_attn_implementation(True, None, "cpu")
    with pytest.raises(ModelError, match="conflicts with attn_implementation='eager'"):
        resolve_attn_implementation(True, "eager", "cpu")
    with pytest.raises(ModelError, match="Did you mean 'sdpa'"):
        resolve_attn_implementation(False, "spda", "cpu")


def test_fp16_on_cpu_and_bf16_on_old_gpu(instruct_path, monkeypatch):
    with pytest.raises(ModelError, match="fp16 was requested for a model on CPU.*Fix: use dtype 'fp32'"):
        load_hf_model(instruct_path, torch_dtype="fp16", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ModelError, match="Tesla V100 does not support bfloat16.*Fix: use dtype 'fp16'"):
        check_dtype_for_device(torch.bfloat16, "cuda")
    check_dtype_for_device(torch.bfloat16, "cpu")  # bf16 on CPU works
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_dtype_for_device(torch.bfloat16, "cuda")  # no GPU here: a check of a GPU run assumes a bf16-capable one


def test_bf16_default_and_auto_dtype(instruct_path):
    model, _ = load_hf_model(instruct_path, device="cpu")
    assert model.verl_load_report.dtype == "bf16" and next(model.parameters()).dtype == torch.bfloat16
    model, _ = load_hf_model(instruct_path, torch_dtype="auto", device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # the checkpoint's dtype


def test_resolve_dtype_spellings():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float32") is torch.float32
    assert resolve_dtype(" BFloat16 ") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(ConfigError, match=r"model.dtype='bf61' is not a known dtype. Did you mean 'bf16'"):
        resolve_dtype("bf61", where="model.dtype")
    with pytest.raises(ConfigError, match="not a floating-point dtype"):
        resolve_dtype(torch.int64)
    with pytest.raises(ConfigError, match="must be a string"):
        resolve_dtype(16)


def test_trust_remote_code_needs_recent_transformers(instruct_path, monkeypatch):
    monkeypatch.setattr(hf_loader, "_transformers_version", lambda: (4, 39))
    with pytest.raises(ModelError, match=r"trust_remote_code=True needs transformers >= 4.40.*pip install -U"):
        load(instruct_path, trust_remote_code=True)


def test_model_with_custom_code_says_how_to_enable_it(instruct_path, edited_copy):
    path = edited_copy(instruct_path, "config.json", model_type="verl_custom_arch",
                       auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    with pytest.raises(ModelError, match=r"ships its own Python code .* pass trust_remote_code=True"):
        load(path)


def test_missing_directory_and_weights(tmp_path, instruct_path):
    with pytest.raises(ModelError, match="is not a directory. Fix: pass the directory that holds config.json"):
        load(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="could not load the config of model"):
        load(str(empty))
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cfg_only / name).write_text((Path(instruct_path) / name).read_text())
    with pytest.raises(ModelError, match="could not load the weights .* model.safetensors"):
        load(str(cfg_only))


def test_with_report_collects_problems_without_raising(instruct_path, base_path):
    _, _, report = load_hf_model_with_report(instruct_path, tokenizer_name=base_path, torch_dtype="fp32",
                                             chat=True)
    assert len(report.problems) == 2 and not report.ok


def test_save_reload_gives_identical_logits(instruct_path, tmp_path):
    model, tok = load(instruct_path, for_training=False)
    model.save_pretrained(tmp_path / "copy")
    tok.save_pretrained(tmp_path / "copy")
    again, tok2 = load(str(tmp_path / "copy"), for_training=False)
    batch = tok(["What is 12+7?", "The answer is 19."], return_tensors="pt", padding=True)
    assert tok2(["What is 12+7?"])["input_ids"] == tok(["What is 12+7?"])["input_ids"]
    with torch.no_grad():
        a = model(**batch).logits
        b = again(**batch).logits
    assert torch.equal(a, b)
    saved = json.loads((tmp_path / "copy" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == model.verl_load_report.stop_token_ids


def test_documented_import_path_reexports_the_loader():
    import verl
    import verl.utils.hf_loader as public

    assert public.load_hf_model is hf_loader.load_hf_model is verl.load_hf_model
    assert all(getattr(public, name) is getattr(hf_loader, name) for name in public.__all__)
