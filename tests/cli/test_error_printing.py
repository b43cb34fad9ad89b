"""Errors reach the user as plain text: brackets in a message are text, not rich markup."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from verl.cli import doctor
from verl.cli.main import main, print_error
from verl.errors import ConfigError, RewardError, install_hint

CONFIG = """\
model: {{path: tiny, dtype: float32}}
data: {{train_files: [prompts.jsonl], train_batch_size: 2, max_prompt_length: 32}}
reward: {{functions: [{{name: reward_fn.py:score}}]}}
rollout: {{n: 2, max_new_tokens: 3}}
actor: {{micro_batch_size: 4}}
trainer: {{total_steps: 1, device: cpu, val_before_train: false, run_dir: {run_dir}}}
logging: {{backends: [jsonl]}}
"""

REWARD = '''
def score(prompt, response, ground_truth, **metadata):
    raise ValueError("could not parse the answer after [/INST] in [bold]" + repr(response[:0]))
'''


def test_reward_error_with_brackets_is_printed_intact_by_verl_train(tmp_path: Path, capsys, monkeypatch):
    rows = [{"prompt": f"{a}+1=", "ground_truth": str(a + 1)} for a in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "reward_fn.py").write_text(REWARD, encoding="utf-8")
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(run_dir=tmp_path / "run"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "60")
    code, err = main(["train", str(tmp_path / "cfg.yaml")]), capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "MarkupError" not in err and "Traceback" not in err
    assert "error (RewardError):" in err
    assert "could not parse the answer after [/INST] in [bold]''" in err  # one line, nothing eaten


@pytest.mark.parametrize("text", ["[/INST] closing tag", "[bold]not bold[/bold]", "path runs/[exp]/x", "\\[x]"])
def test_print_error_shows_the_message_verbatim(text, capsys):
    print_error(RewardError(text))
    assert capsys.readouterr().err == f"error (RewardError): {text}\n"


def test_long_error_lines_are_not_hard_wrapped(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    message = "actor.lrr: unknown key. Did you mean 'actor.lr'? Valid keys here: " + ", ".join(["lr"] * 30)
    print_error(ConfigError(message))
    assert message in capsys.readouterr().err


def test_version_flag_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"verl {importlib.metadata.version('verl')}"


def test_install_hints_name_the_package_not_the_index_verl():
    assert install_hint("wandb", "wandb") == "pip install wandb (or, in a verl checkout: pip install -e '.[wandb]')"
    assert install_hint("flash-attn") == "pip install flash-attn"
    for module, hint in doctor.OPTIONAL.items():
        assert "'verl[" not in hint and "pip install " in hint, module


def test_doctor_prints_install_hints_with_their_extras(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "collect", lambda: [("wandb", "missing", doctor.OPTIONAL["wandb"])])
    monkeypatch.setenv("COLUMNS", "300")
    assert doctor.run(None) == 0
    out = capsys.readouterr().out
    assert "pip install -e '.[wandb]'" in out and "logging.backends=[wandb]" in out


def test_tracker_install_hint(tmp_path, monkeypatch):
    from verl.tracking.tracker import Tracker

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"'wandb' but it is not installed\. Fix: pip install wandb "
                                          r"\(or, in a verl checkout: pip install -e '\.\[wandb\]'\)"):
        Tracker(["wandb"], tmp_path)


def test_a_second_positional_is_a_command_line_error(capsys):
    assert main(["train", "a.yaml", "b.yaml"]) == 1
    err = capsys.readouterr().err
    assert "error (ConfigError): unexpected argument 'b.yaml' on the command line after the config file 'a.yaml'" in err
