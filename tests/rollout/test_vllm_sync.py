"""The vLLM engine follows the policy: a stand-in with vLLM's API (``LLM.generate``, ``sleep``/``wake_up``,
``reset_prefix_cache`` and the in-process ``model.load_weights``) that keeps its OWN copy of the weights,
loaded from the model's files as vLLM does. After every update the trainer pushes the policy's weights
into it, so its sampled log-probs equal the policy's; without the push the on-policy guard stops the run."""

from __future__ import annotations

import inspect
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from verl.errors import ConfigError, RolloutError
from verl.rollout import SamplingParams, VLLMEngine
from verl.rollout.sampling import filtered_logprobs
from verl.rollout.weight_sync import policy_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import _dist_workers as W  # noqa: E402
from rl_support import read_metrics, rl_config  # noqa: E402

# vLLM 0.33.0's API, copied from its source (vllm/entrypoints/llm.py; vllm/engine/arg_utils.py for the
# EngineArgs fields that LLM(**kwargs) forwards; vllm/sampling_params.py): (name, kind, default) per parameter.
VLLM_VERSION = "0.33.0"
_KW, _POS = "KEYWORD_ONLY", "POSITIONAL_OR_KEYWORD"
VLLM_SIGNATURES = {
    "__init__": [("model", _POS, None), ("tensor_parallel_size", _KW, 1), ("seed", _KW, 0),
                 ("gpu_memory_utilization", _KW, 0.92), ("enforce_eager", _KW, False)],
    "generate": [("prompts", _POS, None), ("sampling_params", _POS, None), ("use_tqdm", _KW, True)],
    "sleep": [("level", _POS, 1), ("mode", _POS, "abort")],
    "wake_up": [("tags", _POS, None)],
    "reset_prefix_cache": [("reset_running_requests", _POS, False), ("reset_connector", _POS, False)],
}
ENGINE_ARGS = {"distributed_executor_backend", "max_model_len", "enable_sleep_mode", "logprobs_mode", "dtype",
               "trust_remote_code", "data_parallel_size", "max_num_seqs", "enable_prefix_caching"}
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")  # vllm/config/model.py
SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
                   "logit_bias"}


class _Loader:
    """vLLM's model object: `load_weights` takes (HF name, tensor) pairs into the engine's own weights."""

    def __init__(self, model: torch.nn.Module, log: list[str]) -> None:
        self.model, self.log = model, log
        self.on_each_tensor = None  # a test's probe, called as each pushed tensor arrives

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if self.on_each_tensor is not None:
                self.on_each_tensor(name)
            if name not in params:
                raise KeyError(f"stand-in vLLM: unknown weight {name!r}")
            assert tensor.shape == params[name].shape
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        self.log.append("load_weights")
        return loaded


def _sampling_params(**kwargs):
    """`vllm.SamplingParams`: an unknown field is a TypeError, as in vLLM."""
    unknown = set(kwargs) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"SamplingParams got unexpected keyword argument(s) {sorted(unknown)}")
    return SimpleNamespace(**kwargs)


class StandInLLM:
    """`vllm.LLM` with its own weights, sampling with our sampler on them (so equal weights = equal log-probs).

    Like vLLM: the executor picks the GPU (cuda:LOCAL_RANK only with the external launcher, else cuda:0 in
    every process); sleep level 1 copies the weights out, level 2 discards them (NaN here, so sampling from
    them shows); log-probs are the raw model's unless `logprobs_mode="processed_logprobs"`."""

    instances: list[StandInLLM] = []

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, seed: int = 0,
                 gpu_memory_utilization: float = 0.92, enforce_eager: bool = False, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:  # EngineArgs(**kwargs) refuses them
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.kwargs = {"tensor_parallel_size": tensor_parallel_size, "seed": seed,
                       "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager, **kwargs}
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        assert self.logprobs_mode in LOGPROBS_MODES
        if kwargs.get("distributed_executor_backend") == "external_launcher":  # uniproc_executor.py
            self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            assert int(os.environ["RANK"]) >= 0
        else:
            self.device = "cuda:0"
        self.weights = self.load_model(model)
        self.enable_sleep_mode = kwargs.get("enable_sleep_mode", False)
        self.log: list[str] = []
        self.sleeping, self.kv_cache = False, True
        self.loader = _Loader(self.weights, self.log)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.loader)))))
        # vLLM's generator for requests without a seed, seeded once at start (the unseeded requests' noise)
        self.seed_rng = random.Random(seed)
        self.seen_params: list[list] = []  # the SamplingParams of every prompt of every generate() call
        StandInLLM.instances.append(self)

    @staticmethod
    def load_model(model: str) -> torch.nn.Module:
        """The engine's own copy of the weights, read from the model's files."""
        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def sleep(self, level: int = 1, mode: str = "abort"):
        assert self.enable_sleep_mode, "sleep() needs LLM(enable_sleep_mode=True)"
        self.sleeping, self.kv_cache = True, False
        self.last_awake_weights = {k: v.clone() for k, v in self.weights.state_dict().items()}
        if level == 2:  # vllm/v1/worker/gpu_worker.py: weights discarded (buffers kept)
            with torch.no_grad():
                for p in self.weights.parameters():
                    p.fill_(float("nan"))
        self.log.append(f"sleep{level}")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.log.append(f"wake{tags}")
        if tags is None or "kv_cache" in tags:
            self.sleeping, self.kv_cache = False, True
        return not self.sleeping

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.log.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True):
        """Like vLLM's V1 engine: a request with n > 1 fans out into n children, seeded ``seed + j`` when it has
        a seed (vllm/v1/engine/parallel_sampling.py); a child without one gets a seed from the engine's own
        generator, seeded once by ``LLM(seed=...)``. Every token's noise is a function of (the child's seed, the
        token's position) only (vllm/v1/worker/gpu/sample/gumbel.py), so equal seeds on equal prompts sample
        identical responses. ``sampling_params`` is one for all prompts or one per prompt, as in vLLM."""
        assert not self.sleeping and self.kv_cache, "generate() on a sleeping engine"
        self.log.append("generate")
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(per_prompt) == len(prompts), "vLLM: one SamplingParams, or one per prompt"
        self.seen_params.append(per_prompt)
        children = []  # (prompt index, its params, the child's seed)
        for i, params in enumerate(per_prompt):
            for j in range(params.n):
                seed = params.seed + j if params.seed is not None else self.seed_rng.getrandbits(63)
                children.append((i, params, seed))
        sampled = _gumbel_sample(self.weights, [prompts[i]["prompt_token_ids"] for i, _, _ in children],
                                 [params for _, params, _ in children], [seed for _, _, seed in children],
                                 processed=self.logprobs_mode == "processed_logprobs")
        results = [SimpleNamespace(outputs=[]) for _ in prompts]
        for (i, _, _), (tokens, logprobs) in zip(children, sampled, strict=True):
            entries = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
            results[i].outputs.append(SimpleNamespace(token_ids=tokens, logprobs=entries))
        return results


def _noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise over the vocabulary, a function of (seed, position) alone (vLLM: tl.randint(seed, pos))."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63)
    u = torch.rand(vocab, generator=generator, dtype=torch.float64).clamp_min(1e-300)
    return -(-u.log()).log()


def draw(logits: torch.Tensor, p, seed: int, position: int, *, processed: bool) -> tuple[int, float]:
    """One token from one row's last logits [V], as vLLM's V1 sampler draws it: the request's `logit_bias` added
    first (a logits processor), then greedy or the Gumbel-max trick on the filtered distribution (temperature,
    top-k, top-p) with the noise of (seed, position). Returns (token, its log-prob: the filtered distribution's
    when `processed`, else the raw model's)."""
    raw = logits
    if getattr(p, "logit_bias", None):
        logits = logits.clone()
        logits[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.temperature == 0:
        tok = int(logits.argmax())
        return tok, float(raw.log_softmax(-1)[tok])
    filtered = filtered_logprobs(logits.unsqueeze(0), p.temperature, p.top_k if p.top_k > 0 else None, p.top_p)[0]
    tok = int((filtered.double() + _noise(seed, position, filtered.shape[-1])).argmax())
    return tok, float(filtered[tok]) if processed else float(raw.log_softmax(-1)[tok])


def _gumbel_sample(model, prompts: list[list[int]], params: list, seeds: list[int], *, processed: bool):
    """Sample every row (one child request each) with the Gumbel-max trick on the filtered distribution our
    trainer uses (temperature, top-k, top-p), the noise of token t of row r being _noise(seeds[r], position):
    rows are independent of one another except through their seeds. Returns (tokens, log-probs) per row: the
    log-probs of the filtered distribution (processed) or of the raw model's."""
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left-padded, as the trainer lays prompts out
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    live = set(range(rows))
    steps = max(p.max_tokens for p in params)
    for step in range(steps):
        if not live:
            break
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1].float()
        feed = torch.zeros(rows, dtype=torch.long)
        for r in sorted(live):
            p = params[r]
            tok, lp = draw(logits[r], p, seeds[r], len(prompts[r]) + step, processed=processed)
            tokens[r].append(tok)
            logprobs[r].append(lp)
            feed[r] = tok
            if tok in p.stop_token_ids or len(tokens[r]) >= p.max_tokens:
                live.discard(r)
        ids = torch.cat([ids, feed.unsqueeze(1)], 1)
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
    return list(zip(tokens, logprobs, strict=True))


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = StandInLLM
    module.SamplingParams = _sampling_params
    module.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(StandInLLM, "instances", [])
    # The start-up pass refuses vllm on a CPU machine (tests/cli/test_check_vllm.py); the stand-in runs on CPU.
    monkeypatch.setattr("verl.trainer.checks.startup.check_rollout_engine", lambda engine, device_type: [])
    return module


def _trainer(tmp_path, *extra):
    from verl.trainer.rl_trainer import RLTrainer

    # temperature != 1: the engine's log-probs must be the tempered distribution's, as the trainer's are
    config = rl_config(tmp_path, "rollout.engine=vllm", "trainer.total_steps=4", "actor.lr=0.05",
                       "actor.grad_clip=null", "rollout.temperature=0.7", *extra)

    class Watched(RLTrainer):
        def update_policy(self, batch):
            llm = self.engine.llm
            assert llm.sleeping and not llm.kv_cache  # memory free for the update ...
            assert llm.log[-1] == "sleep2"  # ... the weights too: discarded, not copied to host (pushed anyway)
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
    for name, tensor in llm.last_awake_weights.items():  # ... and the engine held exactly its weights
        torch.testing.assert_close(tensor, policy[name], rtol=0, atol=0)
    # every rollout: wake the weights, load, drop cached prefixes, wake the KV cache, generate, sleep again
    first = llm.log.index("generate")
    assert llm.log[:1] == ["sleep2"]  # asleep from construction until the first rollout
    assert llm.log[first - 4:first + 2] == ["wake['weights']", "load_weights", "reset_prefix_cache",
                                             "wake['kv_cache']", "generate", "sleep2"]
    assert "sleep1" not in llm.log
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.log.count("load_weights") == llm.log.count("generate") >= 4


def test_without_the_weight_push_the_guard_stops_the_run(tmp_path, stand_in_vllm, monkeypatch):
    stale: dict[str, torch.Tensor] = {}
    push = VLLMEngine.load_policy_weights

    def push_the_initial_weights(self, weights):  # an engine that never follows the policy's updates
        for name, tensor in weights:
            stale.setdefault(name, tensor.clone())
        push(self, stale.items())

    monkeypatch.setattr(VLLMEngine, "load_policy_weights", push_the_initial_weights)
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


# ------------------------------------------------------------------------------------ vLLM's API, colocated
def _params(live) -> list[tuple[str, str, object]]:
    out = []
    for p in inspect.signature(live).parameters.values():
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            out.append((p.name, p.kind.name, None if p.default is p.empty else p.default))
    return out


def test_stand_in_has_the_signatures_of_vllm_0_33():
    """Every parameter the stand-in takes is vLLM's, of the same kind and default (copied from vLLM 0.33.0's
    source), so a call that the stand-in accepts is one that vLLM accepts."""
    for method, real in VLLM_SIGNATURES.items():
        assert _params(getattr(StandInLLM, method)) == real, method
    assert {"distributed_executor_backend", "max_model_len", "enable_sleep_mode", "logprobs_mode"} <= ENGINE_ARGS


def test_copied_signatures_are_the_installed_vllms():
    """Where vLLM is installed (GPU machines), the copied signatures are checked against it."""
    vllm = pytest.importorskip("vllm")
    if getattr(vllm, "__version__", "") == "stand-in":
        pytest.skip("stand-in")
    from vllm.engine.arg_utils import EngineArgs

    for method, copied in VLLM_SIGNATURES.items():
        live = {name: (kind, default) for name, kind, default in _params(getattr(vllm.LLM, method))}
        for name, kind, default in copied:
            assert live.get(name) == (kind, default), f"vllm {vllm.__version__} LLM.{method}({name})"
    fields = set(inspect.signature(EngineArgs).parameters)
    assert ENGINE_ARGS <= fields, ENGINE_ARGS - fields
    assert SAMPLING_FIELDS <= set(inspect.signature(vllm.SamplingParams).parameters)


def _engine(**kwargs) -> VLLMEngine:
    from verl.models.tiny import build_tiny_model

    return VLLMEngine(build_tiny_model(), **kwargs)


def _prompts():
    ids = torch.tensor([[0, 5, 7, 9], [3, 4, 6, 8]])
    return ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


class _CudaGenerator:
    """A CUDA generator's face on a CPU machine: `.device` says cuda; draws come from a seeded CPU twin."""

    def __init__(self, seed: int) -> None:
        self.device = torch.device("cuda", 0)
        self.twin = torch.Generator().manual_seed(seed)


def test_seed_is_drawn_on_the_generators_device(stand_in_vllm, monkeypatch):
    real_randint, devices = torch.randint, []

    def randint(*args, generator=None, device=None, **kwargs):
        if not isinstance(generator, _CudaGenerator):
            return real_randint(*args, generator=generator, device=device, **kwargs)
        device = torch.device(device if device is not None else "cpu")
        if device.type != generator.device.type:  # what torch raises for a CUDA generator and a CPU tensor
            raise RuntimeError(f"Expected a '{device.type}' device type for generator but found "
                               f"'{generator.device.type}'")
        devices.append(device)
        return real_randint(*args, generator=generator.twin, **kwargs)

    monkeypatch.setattr(torch, "randint", randint)
    engine = _engine(per_request_seeds=True)  # the only mode that draws from the trainer's generator
    engine.load_policy_weights(policy_weights(AutoModelForCausalLM.from_pretrained(engine.model_path)))
    out = engine.generate(*_prompts(), SamplingParams(max_new_tokens=3, n=2), generator=_CudaGenerator(7))
    assert devices == [torch.device("cuda", 0)]  # drawn with device=generator.device
    assert out.response_ids.shape == (4, 3)


def test_cuda_cache_is_emptied_before_every_wake_up(stand_in_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the trainer has used CUDA
    engine = _engine()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.llm.log.append("empty_cache"))
    engine.load_policy_weights(policy_weights(AutoModelForCausalLM.from_pretrained(engine.model_path)))
    wakes = [i for i, entry in enumerate(engine.llm.log) if entry.startswith("wake")]
    assert len(wakes) == 2 and all(engine.llm.log[i - 1] == "empty_cache" for i in wakes)


def test_generating_from_discarded_weights_is_an_error(stand_in_vllm):
    engine = _engine()  # asleep at level 2 from construction: the weights are gone until a push
    with pytest.raises(RolloutError, match=r"discarded.*push the policy's weights first"):
        engine.generate(*_prompts(), SamplingParams(max_new_tokens=2))


def test_under_torchrun_each_rank_gets_its_own_gpu(stand_in_vllm, monkeypatch):
    import verl.rollout.vllm_engine as module

    monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(module.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 2)
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    llm = _engine(seed=42).llm
    assert llm.device == "cuda:1"  # not every rank's engine on GPU 0
    assert (llm.kwargs["distributed_executor_backend"], llm.kwargs["tensor_parallel_size"]) == ("external_launcher", 1)
    assert llm.kwargs["seed"] == 43  # one engine per rank, seeded per rank
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ConfigError, match=r"rank 1 of 2.*LOCAL_RANK.*torchrun"):
        _engine()


def test_one_process_keeps_vllms_own_executor(stand_in_vllm):
    llm = _engine(seed=5).llm
    assert "distributed_executor_backend" not in llm.kwargs and llm.device == "cuda:0" and llm.kwargs["seed"] == 5


def test_rollout_vllm_keys_reach_the_engine(tmp_path, stand_in_vllm):
    trainer = _trainer(tmp_path, "rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.max_model_len=64",
                       "rollout.vllm.enforce_eager=true", "trainer.seed=11")
    kwargs = trainer.engine.llm.kwargs
    assert (kwargs["gpu_memory_utilization"], kwargs["max_model_len"], kwargs["enforce_eager"]) == (0.3, 64, True)
    assert kwargs["seed"] == 11 and kwargs["enable_sleep_mode"] is True


def test_vllm_needs_the_actor_on_every_rank():
    from verl.rollout.engine_check import check_vllm_placement

    assert check_vllm_placement("vllm", (0, 1), 2) == [] and check_vllm_placement("hf", (0,), 2) == []
    (problem,) = check_vllm_placement("vllm", (0,), 2)
    assert isinstance(problem, ConfigError) and "actor on ranks [0] of 2" in str(problem)
    # asynchronous RL: the rollout ranks build engines too, so actor + rollout ranks on every rank is enough
    assert check_vllm_placement("vllm", (0,), 2, rollout_ranks=(1,)) == []
    (problem,) = check_vllm_placement("vllm", (0,), 3, rollout_ranks=(1,))
    assert "the actor on ranks [0] and rollout ranks [1] of 3" in str(problem) and "rank(s) [2]" in str(problem)
    assert "Fix:" in str(problem)


def _two_rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a colocated run: its engine, and whether the policy was sharded while vLLM had the GPU."""
    import json

    from torch.distributed.tensor import DTensor

    W.setup(rank, world, port)
    trainer = _trainer(Path(out_dir), "trainer.total_steps=1")
    llm = trainer.engine.llm

    def policy_sharded() -> bool:
        return all(isinstance(p, DTensor) for p in trainer.model.parameters())

    during_push, during_generate = [], []
    llm.loader.on_each_tensor = lambda name: during_push.append(policy_sharded())
    generate = llm.generate
    llm.generate = lambda *a, **k: (during_generate.append(policy_sharded()), generate(*a, **k))[1]
    trainer.fit()
    report = {"device": llm.device, "backend": llm.kwargs.get("distributed_executor_backend"),
              "seed": llm.kwargs["seed"], "pushed": len(during_push), "sharded_during_push": all(during_push),
              "sharded_during_generate": during_generate and all(during_generate)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow  # ~16 s: two forked gloo ranks building the trainer
def test_two_ranks_each_engine_on_its_gpu_and_the_actor_sharded_while_it_samples(tmp_path, stand_in_vllm):
    """2 gloo ranks, FSDP2 actor: each rank's engine is built for its own GPU, the weights are pushed one
    gathered tensor at a time, and the actor is resharded the whole time vLLM holds the GPU."""
    import json

    W.launch(_two_rank_worker, 2, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1"]
    assert {r["backend"] for r in reports} == {"external_launcher"} and reports[0]["seed"] != reports[1]["seed"]
    for r in reports:
        assert r["pushed"] > 0 and r["sharded_during_push"] and r["sharded_during_generate"], r


def _tensor_parallel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a TP=2 run with vLLM: its engine's launch arguments, the tensors pushed into it, and what it
    sampled."""
    import json

    W.setup(rank, world, port)
    trainer = _trainer(Path(out_dir), "trainer.total_steps=1", "actor.tensor_parallel_size=2",
                       "actor.kl_loss_coef=0.0")
    llm = trainer.engine.llm
    pushed: dict[str, torch.Tensor] = {}
    load = llm.loader.load_weights
    llm.loader.load_weights = lambda weights: load(
        (pushed.setdefault(name, t.detach().clone()), (name, t))[1] for name, t in weights)
    sampled = []
    generate = llm.generate
    llm.generate = lambda *a, **k: (lambda out: (sampled.append([list(c.token_ids) for r in out
                                                                for c in r.outputs]), out)[1])(generate(*a, **k))
    trainer.fit()
    plain = AutoModelForCausalLM.from_pretrained(trainer.engine.model_path, dtype=torch.float32).state_dict()
    report = {"tp": llm.kwargs["tensor_parallel_size"], "seed": llm.kwargs["seed"], "sampled": sampled,
              "pushed": sorted(pushed), "split": any(hasattr(p, "device_mesh") for p in trainer.model.parameters()),
              "whole_and_initial": all(torch.equal(t.float(), plain[name]) for name, t in pushed.items())}
    (Path(out_dir) / f"tp{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow
def test_a_tensor_parallel_group_is_one_vllm_engine_fed_whole_tensors(tmp_path, stand_in_vllm):
    """actor.tensor_parallel_size=2 on 2 gloo ranks: both ranks' engines are built as one 2-way vLLM engine
    (tensor_parallel_size=2, the same seed: vLLM's external launcher needs the same prompts and seed on the ranks
    of a group), each rank pushes the full tensors of the split policy (vLLM's loaders cut each rank's part), and
    both sample the same responses."""
    import json

    W.launch(_tensor_parallel_worker, 2, str(tmp_path))
    reports = [json.loads((tmp_path / f"tp{r}.json").read_text()) for r in range(2)]
    assert [(r["tp"], r["seed"]) for r in reports] == [(2, reports[0]["seed"])] * 2
    for r in reports:
        assert r["split"] and r["pushed"] and r["whole_and_initial"], r
    assert reports[0]["pushed"] == reports[1]["pushed"]
    assert reports[0]["sampled"] and reports[0]["sampled"] == reports[1]["sampled"]
