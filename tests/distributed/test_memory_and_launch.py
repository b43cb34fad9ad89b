"""Memory estimate against a float64 reference, and the torchrun command line."""

from __future__ import annotations

import sys

import pytest

from verl.distributed.launch import build_torchrun_command, spawn_torchrun, strip_nproc_flag
from verl.distributed.mapping import validate_device_mapping
from verl.distributed.memory import estimate_memory
from verl.errors import ConfigError, DeviceMappingError


def mapping(devices, world_size=4, visible=None):
    return validate_device_mapping(
        devices,
        world_size=world_size,
        algorithm_needs_critic=True,
        needs_ref=True,
        needs_reward_model=True,
        role_dtypes={"actor": "bf16", "critic": "bf16", "ref": "bf16", "reward": "bf16"},
        visible_devices=visible,
        cuda_visible_devices=None,
    )


def reference_bytes(n, width, shards, trainable, opt_states, unsharded_params=False):
    """Independent float64 arithmetic: weights (+ grads + optimizer moments) split over `shards` ranks."""
    sharded = float(n) * width / shards
    params = float(n) * width if unsharded_params else sharded
    return params + ((1 + opt_states) * sharded if trainable else 0.0)


def test_split_mapping_per_device_bytes():
    m = mapping({"actor": [0, 1], "critic": [2, 3], "ref": [0], "reward": [3]})
    counts = {"actor": 1_000_000, "critic": 600_000, "ref": 1_000_000, "reward": 300_000}
    est = estimate_memory(counts, {r: "bfloat16" for r in counts}, mapping=m, optimizer="adamw")
    expect = {
        0: reference_bytes(1e6, 2, 2, True, 2) + reference_bytes(1e6, 2, 1, False, 0),
        1: reference_bytes(1e6, 2, 2, True, 2),
        2: reference_bytes(6e5, 2, 2, True, 2),
        3: reference_bytes(6e5, 2, 2, True, 2) + reference_bytes(3e5, 2, 1, False, 0),
    }
    for rank, value in expect.items():
        assert est.total(rank) == pytest.approx(value, rel=1e-12)
    assert est.peak() == (0, est.total(0))
    table = est.render_table()
    assert table.splitlines()[0].split() == ["rank", "roles", "params", "grads", "optimizer", "total"]
    assert table.splitlines()[2].split()[:2] == ["0", "actor,ref"]


def test_the_table_groups_consecutive_ranks_that_hold_the_same():
    m = mapping({"actor": list(range(6)), "ref": [4, 5]}, world_size=6)
    est = estimate_memory({"actor": 1_000_000, "ref": 1_000_000}, {"actor": "float32", "ref": "bfloat16"}, mapping=m)
    rows = [line.split()[:2] for line in est.render_table().splitlines()[2:-1]]
    assert rows == [["0-3", "actor"], ["4-5", "actor,ref"]]  # 128 ranks of a big launch: a line per kind of rank


def test_sharding_strategies_and_optimizers():
    m = mapping(None, world_size=4)
    counts = {"actor": 10_000_000}
    dt = {"actor": "float32"}
    cases = [
        ("FULL_SHARD", "adamw", reference_bytes(1e7, 4, 4, True, 2)),
        ("SHARD_GRAD_OP", "adamw", reference_bytes(1e7, 4, 4, True, 2, unsharded_params=True)),
        ("NO_SHARD", "sgd", reference_bytes(1e7, 4, 1, True, 0)),
        ("HYBRID_SHARD", "sgd_momentum", reference_bytes(1e7, 4, 2, True, 1)),
    ]
    for strategy, opt, value in cases:
        est = estimate_memory(counts, dt, mapping=m, optimizer=opt, sharding=strategy, hybrid_shard_size=2)
        assert est.total(0) == pytest.approx(value, rel=1e-12), strategy
    with pytest.raises(ConfigError, match="optimizer 'lion' has no memory model"):
        estimate_memory(counts, dt, mapping=m, optimizer="lion")


def test_over_device_memory_is_an_error_on_gpu_and_a_warning_on_cpu():
    counts = {"actor": 1_000_000_000}
    cpu = estimate_memory(counts, {"actor": "bf16"}, mapping=mapping(None, world_size=1))
    # 1e9 bf16 weights + grads + 2 AdamW moments = 8e9 bytes = 7.45 GiB
    assert cpu.total(0) == 8 * 10**9
    warnings = cpu.check(4 * 2**30)
    assert len(warnings) == 1
    assert (
        "estimated model state on rank(s) [0] exceeds the device memory of 4.00 GiB (rank 0: 7.45 GiB)"
        in warnings[0]
    )
    assert cpu.check(8 * 2**30) == [] and cpu.check(None) == []
    gpu = estimate_memory(counts, {"actor": "bf16"}, mapping=mapping(None, world_size=1, visible=1))
    with pytest.raises(DeviceMappingError) as info:
        gpu.check(4 * 2**30)
    assert "rank 0: 7.45 GiB" in str(info.value) and "Fix: shard over more ranks" in str(info.value)


def test_torchrun_command_single_and_multi_node():
    cmd = build_torchrun_command(2, ["train", "cfg.yaml", "--nproc", "2", "trainer.steps=3"], python="py")
    assert cmd == [
        "py",
        "-m",
        "verl.distributed.torchrun_quiet",
        "--nproc_per_node=2",
        "--nnodes=1",
        "--standalone",
        "-m",
        "verl.cli.main",
        "train",
        "cfg.yaml",
        "trainer.steps=3",
    ]
    cmd = build_torchrun_command(
        8, ["train", "c.yaml"], nnodes=2, node_rank=1, rdzv_endpoint="h0:29400", python="py"
    )
    assert cmd[3:8] == [
        "--nproc_per_node=8",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h0:29400",
        "--node-rank=1",
    ]
    assert strip_nproc_flag(["train", "--nproc=4", "x=1"]) == ["train", "x=1"]
    assert build_torchrun_command(1, [])[0] == sys.executable


def test_launch_rejects_bad_requests():
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        build_torchrun_command(0, ["train"])
    with pytest.raises(ConfigError, match="--rdzv-endpoint HOST:PORT"):
        build_torchrun_command(2, ["train"], nnodes=2)
    with pytest.raises(ConfigError, match="inside a torchrun worker"):
        spawn_torchrun(2, ["train"], env={"LOCAL_RANK": "0"})
