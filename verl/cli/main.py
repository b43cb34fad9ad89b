"""`verl`: train, check, eval, doctor, data, ckpt, plot, view.

Every subcommand turns a `VerlError` into a short red message and a non-zero exit code instead of a
traceback: user mistakes are explained, not dumped. The message is printed verbatim (no rich markup), so
text such as `[/INST]` in a reward function's error reaches the user intact.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from verl.errors import ConfigError, VerlError

EPILOG = """examples:
  verl train                                   run the built-in demo (tiny model, arithmetic, SFT then GRPO)
  verl train examples/grpo_gsm8k.yaml actor.lr=1e-6 rollout.n=8
  verl train model.path=Qwen/Qwen2.5-0.5B-Instruct data.train_files=train.jsonl reward.functions=[reward.py:fn]
  verl train cfg.yaml --actor_device_ids 0,1 --ref_device_id 0     (legacy flags are accepted)
  verl train cfg.yaml --print-config            show the resolved config as YAML and exit
  verl check cfg.yaml                           every start-up check, no training
  verl data check train.jsonl --kind prompt     validate a dataset
  verl ckpt verify runs/x/checkpoints/step_10   re-hash a checkpoint
  verl eval runs/x/checkpoints/step_10 test.jsonl --n 8 --k 1 4 8 --out eval.json
  verl view runs/x runs/y                       see runs in a browser (--out report.html: one file)
"""


def split_config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the config is the one positional without '='."""
    config, overrides = None, []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"unexpected argument {item!r} on the command line after the config file {config!r}: "
                              "give one config file, then key=value overrides (e.g. actor.lr=1e-6)")
    return config, overrides


def in_typed_order(argv: Sequence[str], items: Sequence[str], unknown: Sequence[str]) -> tuple[list[str], list[str]]:
    """argparse splits a `train`/`check` command line in two: `items`, the first run of positionals, and
    `unknown`, everything after a flag (legacy `--flags`, their values, later `key=value`s). Both keep the
    typed order, so walking `argv` interleaves them again. Returns ([CONFIG] and any stray positional, the
    rest as typed), so that the last `key=value` or legacy flag on the line wins wherever flags sit."""
    typed, i, j = [], 0, 0
    for token in argv:
        if i < len(items) and token == items[i]:
            typed.append(token)
            i += 1
        elif j < len(unknown) and token == unknown[j]:
            typed.append(token)
            j += 1
    typed += [*items[i:], *unknown[j:]]
    positionals, ordered = [], []
    takes_value = False  # the token after `--flag` (no `=`) is its value, not a config file
    for token in typed:
        if token.startswith("-"):
            name, eq, _ = token.lstrip("-").partition("=")
            ordered.append(token)
            takes_value = not eq  # a legacy flag's value; an unknown flag keeps its value for the error
        elif takes_value or "=" in token:
            ordered.append(token)
            takes_value = False
        else:
            positionals.append(token)
    return positionals, ordered


def installed_version() -> str:
    """This install's version, from its package metadata (what `pip show verl` reports)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed; run `pip install -e .` in the checkout)"


def print_error(exc: BaseException | str, message: str | None = None, *, where: str = "") -> None:
    """`error (ConfigError): <message>` on stderr, the message as plain text; `where` names the ranks."""
    from verl.utils.console import labelled, plain_console

    kind = exc if isinstance(exc, str) else type(exc).__name__
    text = str(exc) if message is None else message
    plain_console(stderr=True).print(labelled(f"error ({kind}){where}: ", text, "bold red"))


def _ranks(ranks: list[int], world: int) -> str:
    return f" on every rank ({world})" if len(ranks) == world else f" on rank(s) {', '.join(map(str, ranks))}"


def launch_training(config, nproc: int, argv: list[str], **multinode: Any) -> int:
    """`verl train --nproc N [--nnodes M ...]`: the start-up checks once, here, for the whole world of N x M
    processes (everything but the weights, which only the workers load), then torchrun; each distinct
    worker error is printed once."""
    import tempfile

    from verl.cli.check_cmd import check_device_type
    from verl.distributed.launch import RANK_ERRORS_ENV, read_rank_errors, spawn_torchrun
    from verl.trainer.checks.preflight import preflight

    nodes = multinode.get("nnodes", 1)
    world = nproc * nodes
    # the node count is passed, not inferred: this process is no torchrun worker (no LOCAL_WORLD_SIZE)
    preflight(config, world_size=world, device_type=check_device_type(config), nodes=nodes).raise_if_problems()
    with tempfile.TemporaryDirectory(prefix="verl-rank-errors-") as folder:
        code = spawn_torchrun(nproc, argv, env={**os.environ, RANK_ERRORS_ENV: folder}, **multinode)
        for kind, message, ranks in read_rank_errors(folder):
            print_error(kind, message, where=_ranks(ranks, world))
    return code


def _report_worker_error(exc: VerlError) -> bool:
    """Under `verl train --nproc`, leave the error for the launcher to print once; True if it was left."""
    from verl.distributed.launch import RANK_ERRORS_ENV, write_rank_error

    folder, rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    try:
        write_rank_error(exc, folder, int(rank))
    except OSError:
        return False
    return True


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]",
                        help="optional YAML config, then dotted overrides such as actor.lr=1e-6")


# Keys that say a command line without a config file is the user's own run, not the demo: volcengine/verl
# users train from the command line alone (`data.train_files=... model.path=...`).
OWN_RUN_KEYS = ("data.train_files", "data.val_files", "env.name")


def runs_demo(args: argparse.Namespace) -> bool:
    """`verl train` with no config file and none of `OWN_RUN_KEYS` set runs the built-in demo; the same
    command line naming data files or an env trains on the plain defaults plus the overrides. `verl check`
    checks what `verl train` would run."""
    config_path, overrides = split_config_and_overrides(args.items)
    typed = [*overrides, *(item for item in args.legacy if "=" in item and not item.startswith("-"))]
    keys = {item.partition("=")[0].strip() for item in typed}
    return args.command in ("train", "check") and config_path is None and not keys & set(OWN_RUN_KEYS)


def _load(args: argparse.Namespace):
    from verl.config import load_config

    config_path, overrides = split_config_and_overrides(args.items)
    if runs_demo(args):
        from verl.demos.arithmetic import demo_config_path

        config = load_config(demo_config_path(), overrides, legacy_argv=args.legacy)
        config._source_dir = None  # relative paths on the command line are the user's, not the preset's folder
        return config
    return load_config(config_path, overrides, legacy_argv=args.legacy)


def cmd_train(args: argparse.Namespace) -> int:
    from verl.config import config_to_yaml

    config = _load(args)
    if args.print_config:
        sys.stdout.write(config_to_yaml(config))
        return 0
    if (args.nproc and args.nproc > 1) or args.nnodes > 1:
        from verl.distributed.launch import multinode_options

        return launch_training(config, args.nproc, ["train", *args.items, *args.legacy], **multinode_options(args))
    from verl.cli.train_cmd import run_training

    return run_training(config, demo=runs_demo(args))


def cmd_check(args: argparse.Namespace) -> int:
    if args.items[:1] == ["model"]:
        from verl.cli.check_model import run_check_model

        if len(args.items) != 2:
            raise VerlError("usage: verl check model NAME_OR_PATH [--tokenizer PATH]")
        return run_check_model(args.items[1], tokenizer=args.tokenizer,
                               trust_remote_code=args.trust_remote_code, dtype=args.dtype)
    from verl.cli.check_cmd import run_checks

    if args.nnodes > 1 and not args.nproc:
        raise ConfigError(f"--nnodes {args.nnodes} without --nproc: say how many processes each node starts, as "
                          "for `verl train`. Fix: --nproc 8 --nnodes 2.")
    return run_checks(_load(args), nproc=args.nproc * args.nnodes if args.nproc else None,
                      nodes=args.nnodes if args.nproc else None, gpu_memory_gib=args.gpu_memory)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl",
        description="verl: reinforcement-learning post-training (PPO, GRPO, RLOO, REINFORCE++, DPO, SFT) "
        "for Hugging Face causal language models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"verl {installed_version()}",
                        help="print the installed verl version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train", help="Train (with no config: the built-in demo).",
        description="Train a model. With no config, runs the built-in demo: a tiny local model learns "
        "arithmetic with SFT then GRPO on CPU in a few minutes. Legacy flags (--actor_device_ids 0,1, "
        "--critic_device_ids, --ref_device_id, --reward_device_id, --teacher_device_ids, --num_gpus_per_node, "
        "--save_interval, --async_save, --save_total_limit) are accepted as aliases of the devices.* / "
        "checkpoint.* keys. "
        "Overrides apply over the config file in the order typed: the last key=value or legacy flag that sets "
        "a key wins, wherever other flags sit.",
        epilog="example: verl train examples/grpo_gsm8k.yaml trainer.total_steps=200 actor.lr=1e-6",
    )
    _add_run_arguments(train)
    train.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    train.add_argument("--nproc", type=int, default=None,
                       help="launch N processes with torchrun (one per device) and train on all of them")
    train.add_argument("--nnodes", type=int, default=1,
                       help="(with --nproc) number of nodes; run the same command on every node")
    train.add_argument("--node-rank", type=int, default=None, help="(with --nnodes) this node's index, 0..N-1")
    train.add_argument("--rdzv-endpoint", default=None,
                       help="(with --nnodes) HOST:PORT of one node that every node reaches (c10d rendezvous)")
    train.set_defaults(func=cmd_train)

    check = sub.add_parser(
        "check", help="Run every start-up validation without training.",
        description="`verl check CONFIG.yaml [key=value]`: devices, dtypes, model/tokenizer, data, FSDP, "
        "batch arithmetic and a memory estimate, no training. `verl check model NAME_OR_PATH`: the "
        "model/tokenizer load report only.",
    )
    _add_run_arguments(check)
    check.add_argument("--tokenizer", default=None, help="(check model) tokenizer path if it differs")
    check.add_argument("--trust-remote-code", action="store_true", help="(check model) allow model code")
    check.add_argument("--dtype", default="float32", help="(check model) dtype to load with")
    check.add_argument("--nproc", type=int, default=None,
                       help="check the run `verl train --nproc N` would start (default: 1 process, as `verl "
                       "train` without --nproc)")
    check.add_argument("--nnodes", type=int, default=1, help="(with --nproc) number of nodes, as for `verl train`")
    check.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                       help="plan GPU memory for devices of GIB GiB (as torch reports total memory: 79.1 for an "
                       "H100 80GB); default: this machine's GPU")
    check.set_defaults(func=cmd_check)

    from verl.cli import ckpt_cmd, compat_cmd, data_cmd, doctor, eval_cmd, view_cmd

    compat_cmd.register(sub)
    doctor.register(sub)
    data_cmd.register(sub)
    ckpt_cmd.register(sub)
    eval_cmd.register(sub)
    from verl.tracking import plot

    plot.register(sub)
    view_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in {"train", "check"}:
        args.items, args.legacy = in_typed_order(argv, args.items, unknown)
    elif args.command == "eval" and unknown and not any(u.startswith("-") for u in unknown):
        args.items = [*args.items, *unknown]  # key=value overrides typed after a flag
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in {"train", "eval"}:
        from verl.models.hf_loader import quiet_hf_console

        quiet_hf_console()
    try:
        return int(args.func(args) or 0)
    except VerlError as exc:
        if not _report_worker_error(exc):
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            print_error(exc, where=f" on rank {os.environ.get('RANK', '?')}" if world > 1 else "")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
