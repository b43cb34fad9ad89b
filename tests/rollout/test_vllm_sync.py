"""The vLLM engine follows the policy: a stand-in with vLLM's API (``LLM.generate``, ``sleep``/``wake_up``,
``reset_prefix_cache`` and the in-process ``model.load_weights``) that keeps its OWN copy of the weights,
loaded from the model's files as vLLM does. After every update the trainer pushes the policy's weights
into it, so its sampled log-probs equal the policy's; without the push the on-policy guard stops the run."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.errors import RolloutError
from verl.rollout import HFKVCacheEngine, SamplingParams, VLLMEngine
from verl.rollout.weight_sync import policy_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from rl_support import read_metrics, rl_config  # noqa: E402


class _Loader:
    """vLLM's model object: `load_weights` takes (HF name, tensor) pairs into the engine's own weights."""

    def __init__(self, model: torch.nn.Module, log: list[str]) -> None:
        self.model, self.log = model, log

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"stand-in vLLM: unknown weight {name!r}")
            assert tensor.shape == params[name].shape
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        self.log.append("load_weights")
        return loaded


class StandInLLM:
    """`vllm.LLM` with its own weights, sampling with our sampler on them (so equal weights = equal log-probs)."""

    def __init__(self, model: str, gpu_memory_utilization: float, enable_sleep_mode: bool = False, **kwargs):
        self.weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.enable_sleep_mode = enable_sleep_mode
        self.log: list[str] = []
        self.sleeping, self.kv_cache = False, True
        runner = SimpleNamespace(model=_Loader(self.weights, self.log))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)))

    def sleep(self, level: int = 1) -> None:
        assert self.enable_sleep_mode, "sleep() needs LLM(enable_sleep_mode=True)"
        self.sleeping, self.kv_cache = True, False
        self.log.append(f"sleep{level}")

    def wake_up(self, tags=None) -> None:
        self.log.append(f"wake{tags}")
        if tags is None or "kv_cache" in tags:
            self.sleeping, self.kv_cache = False, True

    def reset_prefix_cache(self) -> None:
        self.log.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.sleeping and self.kv_cache, "generate() on a sleeping engine"
        self.log.append("generate")
        width = max(len(p["prompt_token_ids"]) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            tokens = p["prompt_token_ids"]
            ids[i, width - len(tokens):], mask[i, width - len(tokens):] = torch.tensor(tokens), 1
        ours = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                              top_k=None if params.top_k == -1 else params.top_k, max_new_tokens=params.max_tokens,
                              n=params.n, eos_token_ids=params.stop_token_ids)
        generator = torch.Generator().manual_seed(params.seed or 0)
        out = HFKVCacheEngine(self.weights).generate(ids, mask, ours, generator=generator)
        results = []
        for i in range(len(prompts)):
            completions = []
            for j in range(params.n):
                row = i * params.n + j
                length = int(out.response_mask[row].sum())
                tokens = out.response_ids[row, :length].tolist()
                logprobs = [{t: SimpleNamespace(logprob=float(lp))} for t, lp in
                            zip(tokens, out.logprobs[row, :length], strict=True)]
                completions.append(SimpleNamespace(token_ids=tokens, logprobs=logprobs))
            results.append(SimpleNamespace(outputs=completions))
        return results


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = StandInLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    module.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "vllm", module)
    # The start-up pass refuses vllm on a CPU machine (tests/cli/test_check_vllm.py); the stand-in runs on CPU.
    monkeypatch.setattr("verl.trainer.startup.check_rollout_engine", lambda engine, device_type: [])
    return module


def _trainer(tmp_path, *extra):
    from verl.trainer.rl_trainer import RLTrainer

    config = rl_config(tmp_path, "rollout.engine=vllm", "trainer.total_steps=4", "actor.lr=0.05",
                       "actor.grad_clip=null", *extra)

    class Watched(RLTrainer):
        def update_policy(self, batch):
            assert self.engine.llm.sleeping and not self.engine.llm.kv_cache  # memory free for the update
            return super().update_policy(batch)

    return Watched(config)


@pytest.mark.parametrize("extra", [["actor.kl_loss_coef=0.01"], []], ids=["old-logprobs", "sampled-subset"])
def test_vllm_engine_samples_from_the_updated_policy(tmp_path, stand_in_vllm, extra):
    trainer = _trainer(tmp_path, *extra)
    assert isinstance(trainer.engine, VLLMEngine)
    llm = trainer.engine.llm
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:  # the engine's own log-probs equal the policy's at every step, not only the first
        assert row["rollout/logprob_diff_max"] < 1e-4
    policy = trainer.model.state_dict()
    moved = max(float((policy[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # the policy really changed ...
    for name, tensor in llm.weights.state_dict().items():  # ... and the engine holds exactly its weights
        torch.testing.assert_close(tensor, policy[name], rtol=0, atol=0)
    # every rollout: wake the weights, load, drop cached prefixes, wake the KV cache, generate, sleep again
    first = llm.log.index("generate")
    assert llm.log[:1] == ["sleep1"]  # asleep from construction until the first rollout
    assert llm.log[first - 4:first + 2] == ["wake['weights']", "load_weights", "reset_prefix_cache",
                                             "wake['kv_cache']", "generate", "sleep1"]
    assert llm.log.count("load_weights") == llm.log.count("generate") >= 4


def test_without_the_weight_push_the_guard_stops_the_run(tmp_path, stand_in_vllm, monkeypatch):
    monkeypatch.setattr(VLLMEngine, "load_policy_weights", lambda self, weights: self.wake_up())
    trainer = _trainer(tmp_path)
    with pytest.raises(RolloutError, match=r"the 'vllm' rollout engine's log-probs differ"):
        trainer.fit()
    assert 1 <= trainer.step_count < 4


def test_unreachable_weight_loader_is_a_rollout_error_with_the_fix(tmp_path, stand_in_vllm):
    from verl.models.tiny import build_tiny_model

    engine = VLLMEngine(build_tiny_model())
    engine.llm.llm_engine = SimpleNamespace()  # e.g. vLLM's engine core in another process
    with pytest.raises(RolloutError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING=0.*rollout.engine=hf"):
        engine.load_policy_weights([])


def test_lora_policy_is_pushed_merged_under_the_base_names():
    peft = pytest.importorskip("peft")
    from verl.models.tiny import build_tiny_model

    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
    names = {n for n, _ in base.named_parameters()}
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter (B starts at zero)
    pushed = dict(policy_weights(model))
    assert set(pushed) == names  # the names the engine loaded from the base model's files
    merged = model.merge_and_unload().state_dict()
    changed = 0
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6)
        changed += "q_proj.weight" in name or "v_proj.weight" in name
    assert changed > 0
