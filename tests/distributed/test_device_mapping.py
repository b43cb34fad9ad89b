"""Pure checks of the device mapping: every invalid placement is rejected before any model loads."""

from __future__ import annotations

import pytest

from verl.config import load_config
from verl.distributed.mapping import DeviceMapping, validate_device_mapping
from verl.errors import DeviceMappingError

BF16 = {"actor": "bfloat16", "critic": "bfloat16", "ref": "bfloat16", "reward": "bfloat16"}


def check(
    devices=None,
    *,
    world_size=4,
    critic=True,
    ref=True,
    reward=True,
    dtypes=None,
    visible=None,
    cvd=None,
    nodes=1,
) -> DeviceMapping:
    return validate_device_mapping(
        devices,
        world_size=world_size,
        algorithm_needs_critic=critic,
        needs_ref=ref,
        needs_reward_model=reward,
        role_dtypes=BF16 if dtypes is None else dtypes,
        visible_devices=visible,
        cuda_visible_devices=cvd,
        nodes=nodes,
    )


def rejected(**kwargs) -> str:
    devices = kwargs.pop("devices", None)
    with pytest.raises(DeviceMappingError) as info:
        check(devices, **kwargs)
    return str(info.value)


def test_default_is_colocated_on_every_rank():
    m = check(None, world_size=2)
    assert m.roles == {"actor": (0, 1), "critic": (0, 1), "ref": (0, 1), "reward": (0, 1)}
    assert m.is_colocated()
    assert m.roles_on(1) == ["actor", "critic", "ref", "reward"]
    assert m.casts == () and m.notes == ()


def test_split_mapping_is_accepted_and_rendered():
    m = check({"actor": [1, 0], "critic": [2, 3], "ref": [0], "reward": [3]}, visible=4, cvd="0,1,2,3")
    assert m.roles == {"actor": (0, 1), "critic": (2, 3), "ref": (0,), "reward": (3,)}
    assert not m.is_colocated()
    assert m.roles_on(0) == ["actor", "ref"] and m.roles_on(3) == ["critic", "reward"]
    table = m.render_table().splitlines()
    assert table[0].split() == ["role", "ranks", "devices", "dtype"]
    assert table[2].split() == ["actor", "0,1", "cuda:0,cuda:1", "bfloat16"]
    assert table[5].split() == ["reward", "3", "cuda:3", "bfloat16"]


def test_multi_node_labels_name_the_node():
    m = check({"actor": [0, 1, 2, 3]}, critic=False, ref=False, reward=False, visible=2, nodes=2)
    assert [m.device_label(r) for r in range(4)] == [
        "node0:cuda:0",
        "node0:cuda:1",
        "node1:cuda:0",
        "node1:cuda:1",
    ]


def test_ids_outside_the_world():
    msg = rejected(devices={"actor": [0, 1], "critic": [2, 5]}, world_size=4)
    assert "devices.critic has rank(s) [5] outside the world of 4 process(es)" in msg
    assert "valid: 0..3" in msg and "Fix:" in msg
    assert ["critic", "2,5", "-", "bfloat16"] in [line.split() for line in msg.splitlines()]  # as asked


def test_world_larger_than_visible_devices_shows_cuda_visible_devices():
    msg = rejected(world_size=4, visible=2, cvd="0,1")
    assert "4 processes per node but only 2 visible devices (CUDA_VISIBLE_DEVICES=0,1)" in msg
    assert "invalid device ordinal" in msg and "--nproc_per_node=2" in msg


def test_num_gpus_per_node_differs_from_actual():
    msg = rejected(devices={"num_gpus_per_node": 8}, world_size=4, visible=4, cvd=None)
    assert (
        "devices.num_gpus_per_node=8 but this node has 4 visible devices (CUDA_VISIBLE_DEVICES=unset)" in msg
    )
    assert "set devices.num_gpus_per_node=4" in msg


def test_num_gpus_per_node_differs_from_launched_world_on_cpu():
    msg = rejected(devices={"num_gpus_per_node": 4}, world_size=2, visible=None)
    assert "devices.num_gpus_per_node=4 x 1 node(s) = 4 ranks, but 2 processes were launched" in msg


def test_role_with_no_device():
    msg = rejected(devices={"ref": []})
    assert "devices.ref is empty: the ref role has no device" in msg and "devices.ref=[0]" in msg


def test_critic_missing_for_gae():
    msg = rejected(devices={"critic": []})
    assert "devices.critic is empty, but the advantage estimator (gae) needs a critic" in msg
    free = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert f"use a critic-free estimator ({', '.join(free)})" in msg  # names the config accepts
    for name in free:
        load_config(overrides=[f"algorithm.adv_estimator={name}"])


def test_critic_placement_ignored_without_critic_is_reported():
    m = check({"critic": [1]}, critic=False, world_size=2)
    assert "critic" not in m.roles
    assert m.notes == ("devices.critic=[1] is ignored: this run has no critic model.",)


def test_duplicate_ranks():
    assert "devices.actor lists rank(s) [1] more than once" in rejected(devices={"actor": [0, 1, 1]})


def test_dtype_mismatch_is_an_error_without_allow_mixed_dtype():
    dtypes = {**BF16, "reward": "float16"}
    msg = rejected(dtypes=dtypes)
    assert "dtype mismatch: actor=bfloat16 but reward=float16" in msg
    assert "devices.allow_mixed_dtype=true" in msg
    assert ["reward", "all", "(4)", "all", "float16"] in [line.split() for line in msg.splitlines()]


def test_allowed_mixed_dtype_reports_the_explicit_cast():
    m = check({"allow_mixed_dtype": True}, dtypes={**BF16, "reward": "fp16"})
    assert m.dtypes["reward"] == "float16"
    assert m.casts == (
        "reward runs in float16 while the actor runs in bfloat16: its outputs are cast to float32 explicitly "
        "before they meet the actor's (allowed by devices.allow_mixed_dtype).",
    )


def test_dtype_aliases_are_not_a_mismatch_and_missing_reward_dtype_is_fine():
    m = check(None, dtypes={"actor": "bf16", "critic": "bfloat16", "ref": "bfloat16", "reward": None})
    assert m.dtypes == {"actor": "bfloat16", "critic": "bfloat16", "ref": "bfloat16", "reward": None}


def test_unknown_dtype():
    assert "actor dtype 'float8' (model.dtype) is not a dtype verl knows" in rejected(
        dtypes={**BF16, "actor": "float8"}
    )


def test_all_problems_are_reported_together():
    msg = rejected(
        devices={"actor": [7], "ref": [], "num_gpus_per_node": 8},
        world_size=2,
        visible=2,
        dtypes={**BF16, "ref": "float32"},
    )
    assert msg.startswith("Invalid device mapping (4 problem(s); world size 2, 1 node(s)")
    for piece in (
        "devices.actor has rank(s) [7]",
        "devices.ref is empty",
        "num_gpus_per_node=8",
        "dtype mismatch: actor=bfloat16 but ref=float32",
    ):
        assert piece in msg


def test_world_not_divisible_by_nodes():
    assert "world size 3 is not divisible by 2 nodes" in rejected(world_size=3, nodes=2)


def test_idle_ranks_are_noted():
    m = check({"actor": [0], "critic": [1], "ref": [0], "reward": [1]}, world_size=3)
    assert m.notes == (
        "rank(s) [2] run no role: their devices stay idle. Give them a role or launch fewer processes.",
    )


def test_attribute_style_devices_section():
    class Devices:  # the lead's pydantic section: read by attribute
        actor = [0]
        critic = None
        ref = None
        reward = None
        num_gpus_per_node = None
        allow_mixed_dtype = False

    m = check(Devices(), world_size=2, reward=False)
    assert m.roles == {"actor": (0,), "critic": (0, 1), "ref": (0, 1)}
