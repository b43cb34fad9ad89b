"""The vLLM engine's result layout and its seeds, against the stand-in `vllm.LLM` of test_vllm_sync.py.

Layout: vLLM's per-request outputs become [rows, max_new] tensors with a fixed number of tensor operations per
call (not one indexed write per token), and the values are exactly those of the per-token loop it replaced.

Seeds: the stand-in models vLLM's seed semantics (a child request's noise is a function of its seed and the
token's position; children of a seeded request get seed + j), so equal seeds on equal prompts sample equal
responses. By default the engine gives no request a seed (vLLM's own generator, seeded once at start), so the
n samples of one prompt, and equal prompts sent as separate requests, all differ."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from verl.rollout import SamplingParams, VLLMEngine
from verl.rollout.vllm_engine import layout_results
from verl.rollout.weight_sync import policy_weights

from .test_vllm_sync import StandInLLM, stand_in_vllm  # noqa: F401 - the fixture


def _per_token_layout(results, n, max_new, pad, eos_ids, mask_dtype=torch.long):
    """The loop VLLMEngine.generate used before (one indexed tensor write per token): the reference."""
    rows = len(results) * n
    response = torch.full((rows, max_new), pad, dtype=torch.long)
    logprobs = torch.zeros((rows, max_new), dtype=torch.float32)
    response_mask = torch.zeros((rows, max_new), dtype=mask_dtype)
    finished = torch.zeros(rows, dtype=torch.bool)
    eos = set(eos_ids)
    for i, result in enumerate(results):
        for j, completion in enumerate(result.outputs[:n]):
            row = i * n + j
            tokens = list(completion.token_ids)[:max_new]
            length = len(tokens)
            response[row, :length] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, :length] = 1
            if completion.logprobs:
                for t, (tok, entry) in enumerate(zip(tokens, completion.logprobs, strict=False)):
                    logprobs[row, t] = float(entry[tok].logprob)
            finished[row] = bool(tokens) and tokens[-1] in eos
    return response, response_mask, logprobs, finished


def _fake_results(requests: int, n: int, max_len: int, seed: int = 0, vocab: int = 50):
    """vLLM-shaped outputs with every case the layout meets: empty, cut (longer than max_new), ending at eos,
    no log-probs, fewer log-prob entries than tokens, fewer completions than n."""
    rng = random.Random(seed)
    results = []
    for i in range(requests):
        outputs = []
        for _ in range(n if i % 5 != 4 else n - 1):
            tokens = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, max_len // 2, max_len, max_len + 3]))]
            if tokens and rng.random() < 0.5:
                tokens[-1] = 2  # an eos
            entries = [{t: SimpleNamespace(logprob=-rng.random() * 7), t + 1: SimpleNamespace(logprob=0.0)}
                       for t in tokens]
            case = rng.random()
            if case < 0.15:
                entries = None
            elif case < 0.3:
                entries = entries[: len(entries) // 2]
            outputs.append(SimpleNamespace(token_ids=tokens, logprobs=entries))
        results.append(SimpleNamespace(outputs=outputs))
    return results


@pytest.mark.parametrize("seed", range(5))
def test_layout_equals_the_per_token_loop(seed):
    results = _fake_results(requests=7, n=3, max_len=9, seed=seed)
    for mask_dtype in (torch.long, torch.int32):
        new = layout_results(results, 3, 9, pad=0, eos_token_ids=[2, 5], mask_dtype=mask_dtype)
        old = _per_token_layout(results, 3, 9, 0, [2, 5], mask_dtype)
        for a, b in zip(new, old, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)


class _CountTensorOps(TorchFunctionMode):
    """Counts every torch call (factories, indexing, writes) made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _count(results, n, max_new) -> list[str]:
    with _CountTensorOps() as counter:
        layout_results(results, n, max_new, pad=0, eos_token_ids=[2])
    return counter.calls


def test_layout_makes_a_fixed_number_of_tensor_ops_whatever_the_tokens_or_requests():
    """Timing-free: the tensor operations do not grow with the tokens (8 vs 512 per response) nor with the
    requests (4 vs 64); the per-token loop made one indexed write per token."""
    small = _count(_fake_results(4, 2, 8), 2, 8)
    long = _count(_fake_results(4, 2, 512), 2, 512)
    many = _count(_fake_results(64, 2, 8), 2, 8)
    assert small == long == many
    assert len(small) <= 16 and small.count("__setitem__") == 2
    with _CountTensorOps() as counter:
        _per_token_layout(_fake_results(4, 2, 512), 2, 512, 0, [2])
    assert counter.calls.count("__setitem__") > 1000  # what it replaced


def _engine(**kwargs) -> VLLMEngine:
    from verl.models.tiny import build_tiny_model

    engine = VLLMEngine(build_tiny_model(), **kwargs)
    engine.load_policy_weights(policy_weights(AutoModelForCausalLM.from_pretrained(engine.model_path)))
    return engine


def _same_prompt(rows: int):
    ids = torch.tensor([[0, 5, 7, 9, 11]] * rows)
    return ids, torch.tensor([[0, 1, 1, 1, 1]] * rows)


PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)


def _responses(out) -> list[tuple[int, ...]]:
    return [tuple(r[m.bool()].tolist()) for r, m in zip(out.response_ids, out.response_mask, strict=True)]


@pytest.mark.usefixtures("stand_in_vllm")
def test_engine_output_is_the_per_token_loops(monkeypatch):
    engine = _engine()
    seen = []
    generate = engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda *a, **k: seen.append(generate(*a, **k)) or seen[-1])
    params = SamplingParams(max_new_tokens=6, temperature=0.9, n=3, eos_token_ids=[3])
    ids = torch.tensor([[0, 5, 7, 9], [3, 4, 6, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = engine.generate(ids, mask, params)
    old = _per_token_layout(seen[0], 3, 6, params.resolved_pad_token_id, [3], mask.dtype)
    for new, ref in zip((out.response_ids, out.response_mask, out.logprobs, out.finished), old, strict=True):
        assert torch.equal(new, ref)


@pytest.mark.usefixtures("stand_in_vllm")
def test_the_stand_in_samples_equal_responses_for_equal_seeds_on_equal_prompts():
    """The hazard the default avoids: one seed for every request (what the engine used to send) makes
    equal prompts sample the same response, as in vLLM."""
    llm = _engine().llm
    params = sys.modules["vllm"].SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=8,
                                          stop_token_ids=[], ignore_eos=True, logprobs=0, seed=1234)
    prompts = [{"prompt_token_ids": [5, 7, 9, 11]}] * 4
    outputs = [tuple(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]
    assert len(set(outputs)) == 1
    unseeded = sys.modules["vllm"].SamplingParams(**{**vars(params), "seed": None})
    outputs = [tuple(r.outputs[0].token_ids) for r in llm.generate(prompts, unseeded, use_tqdm=False)]
    assert len(set(outputs)) == 4


@pytest.mark.usefixtures("stand_in_vllm")
def test_by_default_no_request_carries_a_seed_and_the_n_samples_of_a_prompt_differ():
    engine = _engine(seed=7)
    assert engine.llm.kwargs["seed"] == 7  # vLLM's own generator, seeded once with the run's seed
    out = engine.generate(*_same_prompt(1), SamplingParams(max_new_tokens=8, temperature=1.0, n=4),
                          generator=torch.Generator().manual_seed(0))
    assert len(set(_responses(out))) == 4  # GRPO's group: n different responses
    # equal prompts sent as separate requests (the multi-turn sampler does when its copies are uneven)
    out = engine.generate(*_same_prompt(4), PARAMS, generator=torch.Generator().manual_seed(0))
    assert len(set(_responses(out))) == 4
    assert all(p.seed is None for call in engine.llm.seen_params for p in call)


@pytest.mark.usefixtures("stand_in_vllm")
def test_default_runs_are_reproducible_from_the_engine_seed():
    first = _engine(seed=3).generate(*_same_prompt(3), PARAMS)
    again = _engine(seed=3).generate(*_same_prompt(3), PARAMS)
    other = _engine(seed=4).generate(*_same_prompt(3), PARAMS)
    assert _responses(first) == _responses(again) and _responses(first) != _responses(other)


@pytest.mark.usefixtures("stand_in_vllm")
def test_per_request_seeds_are_distinct_and_reproducible():
    engine = _engine(per_request_seeds=True)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=3)
    out = engine.generate(*_same_prompt(4), params, generator=torch.Generator().manual_seed(11))
    (call,) = engine.llm.seen_params
    seeds = [p.seed for p in call]
    children = {s + j for s in seeds for j in range(3)}  # vLLM seeds child j of a request seed + j
    assert len(children) == 12 and all(0 <= s < 2**63 for s in children)
    assert len(set(_responses(out))) == 12  # equal prompts, n each: all differ
    # the same generator state gives the same responses in a fresh engine; the next step's state, others
    again = _engine(per_request_seeds=True).generate(*_same_prompt(4), params,
                                                     generator=torch.Generator().manual_seed(11))
    assert _responses(again) == _responses(out)
    generator = torch.Generator().manual_seed(11)
    engine.generate(*_same_prompt(4), params, generator=generator)
    later = engine.generate(*_same_prompt(4), params, generator=generator)
    assert _responses(later) != _responses(out)
    # without a generator: from (engine seed, call index), different every call
    bare = _engine(per_request_seeds=True, seed=5)
    bare.generate(*_same_prompt(2), PARAMS)
    bare.generate(*_same_prompt(2), PARAMS)
    first, second = ([p.seed for p in call] for call in bare.llm.seen_params)
    assert first != second and len(set(first)) == 2
    assert [p.seed for p in _engine(per_request_seeds=True, seed=5).llm.seen_params] == []
    replay = _engine(per_request_seeds=True, seed=5)
    replay.generate(*_same_prompt(2), PARAMS)
    assert [p.seed for p in replay.llm.seen_params[0]] == first


@pytest.mark.usefixtures("stand_in_vllm")
def test_stand_in_takes_one_sampling_params_per_prompt():
    assert isinstance(_engine().llm, StandInLLM)
    llm = _engine().llm
    params = sys.modules["vllm"].SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_tokens=3,
                                          stop_token_ids=[], ignore_eos=True, logprobs=0, seed=None)
    with pytest.raises(AssertionError, match="one per prompt"):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, [params], use_tqdm=False)
