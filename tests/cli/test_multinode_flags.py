"""`verl train --nproc N --nnodes M --node-rank R --rdzv-endpoint H:P` reaches torchrun unchanged."""

import pytest

import verl.distributed.launch as launch
from verl.cli.main import main
from verl.errors import ConfigError


@pytest.fixture
def spawned(monkeypatch):
    calls = []

    def fake_spawn(nproc, argv, env=None, **kwargs):
        assert env is None or "VERL_RANK_ERRORS" in env  # where workers leave their errors for the launcher
        calls.append((nproc, argv, kwargs, launch.build_torchrun_command(nproc, argv, python="py", **kwargs)))
        return 0

    monkeypatch.setattr(launch, "spawn_torchrun", fake_spawn)
    return calls


def test_train_passes_multinode_flags_to_torchrun(spawned):
    assert main(["train", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                 "node0.example:29400", "trainer.total_steps=1"]) == 0
    [(nproc, argv, kwargs, cmd)] = spawned
    assert nproc == 2 and argv == ["train", "trainer.total_steps=1"]
    assert kwargs == {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0.example:29400"}
    assert cmd[3:8] == ["--nproc_per_node=2", "--nnodes=2", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=node0.example:29400", "--node-rank=1"]
    assert cmd[cmd.index("verl.cli.main") + 1:] == ["train", "trainer.total_steps=1"]


def test_single_node_launch_is_unchanged(spawned):
    assert main(["train", "--nproc", "2"]) == 0
    [(_, _, kwargs, cmd)] = spawned
    assert kwargs == {"nnodes": 1, "node_rank": None, "rdzv_endpoint": None}
    assert "--standalone" in cmd


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "without --nproc"),
    (["--nproc", "2", "--node-rank", "1"], "without --nnodes"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "must be in 0..1"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0"], "must be HOST:PORT"),
    (["--nproc", "2", "--nnodes", "2"], "--rdzv-endpoint HOST:PORT"),
])
def test_half_given_multinode_launch_is_refused(spawned, argv, message, monkeypatch):
    def check(nproc, argv, env=None, **kwargs):  # the real command builder validates the endpoint itself
        launch.build_torchrun_command(nproc, argv, **kwargs)
        return 0

    monkeypatch.setattr(launch, "spawn_torchrun", check)
    args = launch.strip_nproc_flag(argv)
    assert args == []  # the children never see the launch flags
    from verl.cli.main import build_parser, cmd_train

    parsed, _ = build_parser().parse_known_args(["train", *argv])
    parsed.legacy = []
    with pytest.raises(ConfigError, match=message):
        cmd_train(parsed)


EIGHT_BY_EIGHT = ["--nproc", "8", "--nnodes", "8", "devices.num_gpus_per_node=8", "data.train_batch_size=64"]


def test_eight_nodes_of_eight_are_checked_as_eight_per_node(spawned):
    """The launcher has no LOCAL_WORLD_SIZE (torchrun sets it only in the workers): the node count comes
    from --nnodes, so 64 processes are 8 per node, as devices.num_gpus_per_node says, not 64 on one."""
    assert main(["train", *EIGHT_BY_EIGHT, "--node-rank", "3", "--rdzv-endpoint", "node0:29400",
                 "trainer.total_steps=1"]) == 0
    [(nproc, _, kwargs, _)] = spawned
    assert nproc == 8 and kwargs["nnodes"] == 8


def test_check_counts_the_nodes_of_the_launch(capsys):
    assert main(["check", *EIGHT_BY_EIGHT]) == 0, capsys.readouterr().out
    assert "64 process(es)" in capsys.readouterr().out
    capsys.readouterr()
    # still refused when the launch does not match: 4 per node on 8 nodes, but 8 GPUs per node
    assert main(["check", "--nproc", "4", "--nnodes", "8", "devices.num_gpus_per_node=8",
                 "data.train_batch_size=64"]) == 1
    assert "devices.num_gpus_per_node=8 x 8 node(s) = 64 ranks, but 32" in capsys.readouterr().out
