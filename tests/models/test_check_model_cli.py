"""`verl check model`: prints the load report; exit 1 when the model and tokenizer do not fit."""

from __future__ import annotations

import argparse
import io

from rich.console import Console

from verl.cli.check_model import register_arguments, run_check_model


def _run(*args, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = run_check_model(*args, console=Console(file=out, width=300, color_system=None), **kwargs)
    return code, out.getvalue()


def test_consistent_model_exits_zero(instruct_path):
    code, out = _run(instruct_path)
    assert code == 0
    assert "model load report" in out and "special tokens" in out
    assert "'<|im_end|>'" in out and "present, probe ok" in out and "consistent" in out


def test_mismatch_exits_one_and_prints_problems(instruct_path, base_path):
    code, out = _run(instruct_path, tokenizer=base_path, chat=True)
    assert code == 1
    # named as the command spells it: `verl check model PATH --tokenizer T`
    assert out.count("problem:") == 2 and "drop --tokenizer" in out and "2 problem(s) found" in out
    assert "tokenizer_name" not in out


def test_environment_error_exits_one(instruct_path, tmp_path):
    code, out = _run(instruct_path, dtype="fp16")
    assert code == 1 and "--dtype=fp16 was requested for a model on CPU" in out
    code, out = _run(str(tmp_path / "missing"))
    assert code == 1 and "is not a directory" in out


def test_register_arguments(base_path, capsys):
    parser = argparse.ArgumentParser()
    register_arguments(parser)
    args = parser.parse_args([base_path, "--chat", "--dtype", "fp32"])
    assert args.tokenizer is None and args.trust_remote_code is False
    assert args.func(args) == 1  # the base model has no chat template
    assert "no chat template" in capsys.readouterr().out


def test_tiny_specs_build_locally_as_model_path_does(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: `tiny` must not be looked up on the hub
    code, out = _run("tiny")
    assert code == 0 and "consistent" in out and "qwen2" in out
    code, out = _run("tiny:llama:x")
    assert (code == 1
            and "problem: model.path='tiny:llama:x': expected tiny[:arch[:hidden_size[:num_layers[:variant]]]]" in out)
