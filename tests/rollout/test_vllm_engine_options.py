"""`rollout.vllm.*` reaching the engine the trainer builds (verl.trainer.compose.components.setup_engine), over the
stand-in `vllm.LLM` of test_vllm_sync.py, which records the keyword arguments it was built with: the
asynchronous rollout ranks' own gpu_memory_utilization, per_request_seeds, and the dtype vLLM holds its
weights in, which is the dtype each push is cast to before it is gathered."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.models.tiny import build_tiny_model
from verl.rollout import SamplingParams
from verl.rollout.engine_check import ROLLOUT_RANK_GPU_MEMORY_UTILIZATION, describe_vllm_memory
from verl.rollout.weight_sync import synced
from verl.trainer.compose.components import setup_engine

from .test_vllm_sync import rl_config, stand_in_vllm  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("stand_in_vllm")


def _policy() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)


def test_rollout_ranks_get_their_own_gpu_memory_utilization(tmp_path):
    config = rl_config(tmp_path, "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.4")
    actor = setup_engine(config, _policy())
    rollout = setup_engine(config, _policy(), rollout_rank=True)
    assert actor.llm.kwargs["gpu_memory_utilization"] == 0.4
    assert rollout.llm.kwargs["gpu_memory_utilization"] == ROLLOUT_RANK_GPU_MEMORY_UTILIZATION == 0.9
    assert "rollout_rank_gpu_memory_utilization" not in rollout.llm.kwargs  # ours, not vLLM's
    config = rl_config(tmp_path, "rollout.engine=vllm", "rollout.vllm.rollout_rank_gpu_memory_utilization=0.75")
    assert setup_engine(config, _policy(), rollout_rank=True).llm.kwargs["gpu_memory_utilization"] == 0.75
    assert setup_engine(config, _policy()).llm.kwargs["gpu_memory_utilization"] == 0.5  # the actor's default


@pytest.mark.parametrize("on", [False, True])
def test_per_request_seeds_reaches_the_engine(tmp_path, on):
    config = rl_config(tmp_path, "rollout.engine=vllm", f"rollout.vllm.per_request_seeds={str(on).lower()}")
    policy = _policy()
    engine = setup_engine(config, policy)
    assert engine.per_request_seeds is on
    with synced(engine, policy):
        engine.generate(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long),
                        SamplingParams(max_new_tokens=2, n=2), generator=torch.Generator().manual_seed(3))
    [params] = engine.llm.seen_params
    assert (params[0].seed is not None) is on


def test_the_engine_holds_the_rollout_dtype_and_pushes_are_cast_to_it(tmp_path):
    config = rl_config(tmp_path, "rollout.engine=vllm")
    policy = _policy()
    engine = setup_engine(config, policy, dtype=torch.bfloat16)
    assert engine.llm.kwargs["dtype"] == "bfloat16" and engine.weight_dtype == torch.bfloat16
    received: list[tuple[str, torch.dtype]] = []
    load = engine.llm.loader.load_weights
    engine.llm.loader.load_weights = lambda weights: load(
        (received.append((name, t.dtype)), (name, t))[1] for name, t in weights)
    with synced(engine, policy):
        pass
    assert received and {dtype for _, dtype in received} == {torch.bfloat16}
    held = policy.state_dict()
    for name, tensor in engine.llm.last_awake_weights.items():  # the float32 policy, rounded to bfloat16
        assert torch.equal(tensor, held[name].detach().to(torch.bfloat16).float()), name
    # without a dtype (a VLLMEngine built by hand, vLLM's "auto"): pushed as held
    assert setup_engine(config, policy).weight_dtype is None


def test_check_notes_the_kv_cache_budget_of_asynchronous_vllm_runs():
    note = describe_vllm_memory("vllm", 0.5, None, (2, 3))
    assert ("gpu_memory_utilization=0.5" in note
            and "rollout ranks' [2, 3] rollout_rank_gpu_memory_utilization=0.9" in note)
    assert "smallest KV cache of all ranks" in note and "0.5 x GPU memory" in note
    assert "does not enlarge it" in note
    assert "shrinks the actor ranks' too" in describe_vllm_memory("vllm", 0.5, 0.3, (1,))
    assert "0.3 x GPU memory" in describe_vllm_memory("vllm", 0.5, 0.3, (1,))
    assert describe_vllm_memory("vllm", 0.5, None, ()) is None and describe_vllm_memory("hf", 0.5, None, (1,)) is None


def test_verl_check_prints_the_note_for_an_asynchronous_vllm_run(tmp_path):
    from verl.trainer.checks.startup import check_startup

    config = rl_config(tmp_path, "rollout.engine=vllm", "devices.actor=[0]", "devices.rollout=[1]")
    report = check_startup(config, world_size=2, device_type="cuda", nodes=1)
    [note] = [n for n in report.rl_notes if n.startswith("vLLM memory:")]
    assert "rollout ranks' [1]" in note and "smallest KV cache" in note
    colocated = check_startup(rl_config(tmp_path, "rollout.engine=vllm"), world_size=2, device_type="cuda", nodes=1)
    assert not [n for n in colocated.rl_notes if n.startswith("vLLM memory:")]
