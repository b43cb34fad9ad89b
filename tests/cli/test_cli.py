import subprocess
import sys

import pytest
import yaml

from verl.cli.main import build_parser, main

SUBCOMMANDS = ["train", "check", "eval", "doctor", "data", "ckpt", "plot"]


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert "usage: verl " + name in capsys.readouterr().out


def test_print_config_applies_overrides_and_legacy_flags(capsys):
    assert main(["train", "--print-config", "actor.lr=2e-6", "--actor_device_ids", "0,1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor"]["lr"] == 2e-6 and printed["devices"]["actor"] == [0, 1]


def test_config_error_is_a_message_not_a_traceback(capsys):
    assert main(["train", "actor.lrr=1"]) == 1
    err = capsys.readouterr().err
    assert "actor.lrr" in err and "actor.lr" in err and "Traceback" not in err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "verl.cli", "--help"], capture_output=True, text=True, check=True)
    assert "verl" in out.stdout


def test_parser_builds():
    assert build_parser().prog == "verl"


@pytest.mark.parametrize("argv, lr", [
    (["train", "actor.lr=0.1", "--print-config", "actor.lr=0.2"], 0.2),
    (["train", "--print-config", "actor.lr=0.1", "actor.lr=0.2"], 0.2),
    (["train", "actor.lr=0.2", "--actor_device_ids", "0", "--print-config"], 0.2),
    (["train", "actor.lr=0.1", "--actor_device_ids", "0", "actor.lr=0.2", "--print-config"], 0.2),
])
def test_the_last_key_value_wins_wherever_flags_sit(argv, lr, capsys):
    assert main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["actor"]["lr"] == lr


@pytest.mark.parametrize("argv, interval", [
    (["train", "--print-config", "--save_interval", "5", "checkpoint.save_interval=7"], 7),
    (["train", "--print-config", "checkpoint.save_interval=7", "--save_interval", "5"], 5),
    (["train", "--save_interval", "5", "actor.lr=0.3", "--print-config"], 5),
])
def test_a_legacy_flag_and_its_key_the_last_typed_wins(argv, interval, capsys):
    assert main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["save_interval"] == interval
