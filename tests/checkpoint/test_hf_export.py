"""`verl ckpt export`: a checkpoint becomes a HF folder that reloads with identical logits."""

from __future__ import annotations

import argparse

import pytest
import torch

from verl.checkpoint import CheckpointManager, export_hf
from verl.cli.ckpt_cmd import register
from verl.errors import CheckpointError

transformers = pytest.importorskip("transformers")


def _tiny_qwen2_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

    words = ["<unk>", "<pad>", "<eos>", "the", "answer", "is", "1", "2", "3", "+", "="]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(max_new_tokens=7, eos_token_id=2, pad_token_id=1)
    return model, tok


def _cli(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ckpt", *argv])
    return args.func(args)


def test_export_reloads_with_identical_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    model, tok = _tiny_qwen2_and_tokenizer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([tok.encode("the answer is 1 + 2 = 3")])
    model(ids, labels=ids).loss.backward()  # train one step so the weights differ from the init
    opt.step()
    mgr = CheckpointManager(tmp_path / "run", save_interval=1)
    mgr.save(1, app_state={"model": model, "optimizer": opt}, extra={},
             hf_assets=(model.config, model.generation_config, tok))
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    assert (ckpt / "hf" / "config.json").is_file()

    assert _cli(["export", str(ckpt), "--out", str(tmp_path / "hf_out")]) == 0
    assert "exported" in capsys.readouterr().out
    out = tmp_path / "hf_out"
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    tok2 = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tok2.encode("the answer is 3") == tok.encode("the answer is 3")
    assert GenerationConfig.from_pretrained(str(out)).max_new_tokens == 7

    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_hf(ckpt, out)

    def on_rank_one(config):  # what transformers >= 5 decides on a rank other than 0 of a process group
        model = AutoModelForCausalLM.from_config(config)
        model.should_save_on_this_rank = lambda is_main_process: False
        return model

    with pytest.raises(CheckpointError, match="wrote no weights"):  # not a folder of config and tokenizer alone
        export_hf(ckpt, tmp_path / "rank1_out", model_factory=on_rank_one)
    assert not (tmp_path / "rank1_out").exists() and not list(tmp_path.glob("rank1_out*"))


def test_export_refuses_bad_or_configless_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", save_interval=1)
    mgr.save(1, app_state={"model": torch.nn.Linear(2, 2)}, extra={})
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    with pytest.raises(CheckpointError, match=r"hf/config.json: missing.*hf_assets="):
        export_hf(ckpt, tmp_path / "out")
    (ckpt / "state" / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"(?s)refusing to export.*__0_0.distcp: size"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
