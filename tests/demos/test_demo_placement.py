"""Which demos take split placements: the arithmetic one runs its warm start on the actor's ranks
(`verl.demos.warm_start`); the tool, agent and RLHF demos are refused one before anything loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from verl.config import load_config
from verl.demos.warm_start import first_actor_rank, on_actor_ranks
from verl.errors import DeviceMappingError, DistributedError, VerlError
from verl.trainer.checks.startup import check_startup
from verl.trainer.compose.runtime import on_parts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ASYNC = ["devices.actor=[0]", "devices.rollout=[1]", "rollout.max_staleness=1", "trainer.device=cpu"]


def _refusals(config):
    return [p for p in check_startup(config, world_size=2).problems if "trainer.demo=" in str(p)]


@pytest.mark.parametrize("example,extra", [("tool_calculator.yaml", []), ("agent_tools.yaml", []),
                                           ("rlhf_pipeline.yaml", ["devices.ref=[0]"])])  # its KL reference
def test_demos_that_run_on_every_rank_refuse_a_split_placement(example, extra, tmp_path):
    config = load_config(str(EXAMPLES / example), overrides=[*ASYNC, *extra, f"trainer.run_dir={tmp_path}"])
    refusals = _refusals(config)
    assert len(refusals) == 1 and isinstance(refusals[0], DeviceMappingError)
    message = str(refusals[0])
    assert f"trainer.demo={config.trainer.demo} runs its warm start and its evaluations on every rank" in message
    assert "Fix: remove devices.*" in message and "trainer.demo=arithmetic" in message
    assert "rollout" in message  # the mapping table
    colocated = load_config(str(EXAMPLES / example), overrides=["trainer.device=cpu", f"trainer.run_dir={tmp_path}"])
    assert _refusals(colocated) == []


def test_the_arithmetic_demo_takes_a_split_placement(tmp_path):
    config = load_config(overrides=["trainer.demo=arithmetic", "env.name=arithmetic", "model.path=tiny", *ASYNC,
                                    f"trainer.run_dir={tmp_path}"])
    assert check_startup(config, world_size=2).problems == []


class _Guard:
    def __init__(self, posted=()):
        self.posted = set(posted)

    def signal(self, name):
        self.posted.add(name)

    def signalled(self, name):
        return name in self.posted


def _trainer(rank, *, split=True, actor=(0,), posted=()):
    holds = rank in actor
    placement = SimpleNamespace(split=split, holds=lambda role: holds,
                                mean_over_owners=lambda metrics: {"shared": True, **metrics})
    groups = SimpleNamespace(guard=_Guard(posted), ranks=lambda role: actor)
    return SimpleNamespace(rank=rank, placement=placement, groups=groups if split else None)


def test_colocated_ranks_all_run_the_work():
    assert on_actor_ranks(_trainer(0, split=False), lambda: {"steps": 3.0}) == {"steps": 3.0}
    assert first_actor_rank(_trainer(0, split=False)) == 0


def test_the_actor_ranks_work_and_say_so_the_others_wait_for_it():
    lead = _trainer(1, actor=(1, 2))
    assert on_actor_ranks(lead, lambda: {"steps": 3.0}) == {"shared": True, "steps": 3.0}
    assert lead.groups.guard.posted == {"warm_start/done"} and first_actor_rank(lead) == 1
    waiting = _trainer(0, actor=(1, 2), posted={"warm_start/done"})
    assert on_actor_ranks(waiting, lambda: pytest.fail("a rank without the actor ran the work")) == {"shared": True}


def test_a_failed_actor_rank_stops_the_waiting_ranks():
    failing = _trainer(0)

    def boom():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        on_actor_ranks(failing, boom)
    assert failing.groups.guard.posted == {"warm_start/failed"}
    with pytest.raises(DistributedError, match=r"rank 1 waited for the actor's rank\(s\) \[0\].*Fix: see the error"):
        on_actor_ranks(_trainer(1, posted={"warm_start/failed"}), lambda: {})


def test_a_trainer_on_parts_runs_where_the_actor_is(tmp_path):
    config = load_config(overrides=["model.path=tiny", f"trainer.run_dir={tmp_path}"])
    parts = SimpleNamespace(process=SimpleNamespace(roles={"rollout"}, rank=1), policy=object())
    with pytest.raises(VerlError, match=r"rank 1 holds no actor \(its roles: \['rollout'\]\).*Fix: build it only"):
        on_parts(parts, config)
    parts.process.roles = {"actor"}
    with pytest.raises(VerlError, match="trains that trainer's policy"):
        on_parts(parts, config, model=object())
    assert on_parts(parts, config, model=parts.policy) is parts
