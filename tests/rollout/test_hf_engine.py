"""HFKVCacheEngine: equal to HF greedy, right sampling distribution, layout, compute, errors."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.rollout.conftest import VOCAB, left_padded, make_model
from tests.rollout.test_sampling import chi2_critical, chi_square, reference_logprobs
from verl.errors import ConfigError, DataError
from verl.rollout import HFKVCacheEngine, RolloutOutput, SamplingParams
from verl.rollout.fast_decode import LlamaStyleDecodeStep

LENGTHS = [7, 3, 5, 1, 6, 2]


def hf_greedy(model, ids, mask, max_new: int, eos: list[int], pad: int) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:]
    padded = torch.full((ids.shape[0], max_new), pad, dtype=torch.long)
    padded[:, : out.shape[1]] = out
    return padded


def frequent_tokens(model, ids, mask, max_new: int) -> list[int]:
    """Two eos ids that the greedy continuations hit early in some rows and never in others."""
    free = HFKVCacheEngine(model).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=max_new))
    first = free.response_ids[:, 2].tolist()
    candidates = [t for t in dict.fromkeys(first)]
    for a in candidates:
        for b in candidates:
            hit = (free.response_ids == a) | (free.response_ids == b)
            if 0 < int(hit.any(-1).sum()) < ids.shape[0]:
                return [a, b]
    return [first[0]]


@pytest.mark.parametrize("arch,kwargs", [
    ("qwen2", {}),
    ("qwen2", {"fast_decode": False}),
    ("qwen2", {"fast_decode": False, "prebuilt_masks": False}),
    ("llama", {}),
    ("qwen3", {}),
])
def test_greedy_equals_hf_generate(arch, kwargs):
    model = make_model(arch, seed=1)
    ids, mask = left_padded(LENGTHS, seed=2)
    max_new = 12
    eos = frequent_tokens(model, ids, mask, max_new)
    engine = HFKVCacheEngine(model, **kwargs)
    if not kwargs:
        assert engine.fast_decode_reason == ""
    out = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=max_new, eos_token_ids=eos,
                                                    pad_token_id=0))
    want = hf_greedy(model, ids, mask, max_new, eos, pad=0)
    assert torch.equal(out.response_ids, want)
    # Some rows stopped early at an eos id and some ran to the end.
    assert out.finished.any() and not out.finished.all()
    lengths = out.response_mask.sum(-1)
    assert (lengths[out.finished] < max_new).any()
    assert (lengths[~out.finished] == max_new).all()


def test_greedy_equals_hf_generate_without_fused_projections(monkeypatch):
    monkeypatch.setattr("verl.rollout.fast_decode.MAX_FUSED_BYTES", 0)
    test_greedy_equals_hf_generate("llama", {})


def test_sliding_window_model_takes_the_plain_path_and_matches_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data.normal_(0, 0.4)
            layer.self_attn.k_proj.weight.data.normal_(0, 0.4)
    engine = HFKVCacheEngine(model)
    assert "sliding" in engine.fast_decode_reason or "cache layout" in engine.fast_decode_reason
    ids, mask = left_padded(LENGTHS, seed=3)
    out = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=10))
    assert torch.equal(out.response_ids, hf_greedy(model, ids, mask, 10, [], pad=0))


def test_greedy_equals_hf_generate_with_eager_attention():
    model = make_model("qwen2", seed=4, attn="eager")
    ids, mask = left_padded(LENGTHS, seed=5)
    for kwargs in ({}, {"fast_decode": False}):
        out = HFKVCacheEngine(model, **kwargs).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=10))
        assert torch.equal(out.response_ids, hf_greedy(model, ids, mask, 10, [], pad=0))


def test_output_layout_masks_and_positions(qwen2):
    ids, mask = left_padded(LENGTHS, seed=2)
    eos = frequent_tokens(qwen2, ids, mask, 12)
    out = HFKVCacheEngine(qwen2).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=12,
                                                                    eos_token_ids=eos, pad_token_id=299))
    assert isinstance(out, RolloutOutput)
    for r in range(ids.shape[0]):
        n_real = int(out.response_mask[r].sum())
        tokens = out.response_ids[r].tolist()
        if out.finished[r]:
            assert tokens[n_real - 1] in eos and not set(tokens[: n_real - 1]) & set(eos)
        else:
            assert n_real == 12 and not set(tokens) & set(eos)
        assert tokens[n_real:] == [299] * (12 - n_real)
        assert (out.response_mask[r, :n_real] == 1).all()
        assert (out.logprobs[r, n_real:] == 0).all() and (out.logprobs[r, :n_real] < 0).all()
    assert torch.equal(out.sequences, torch.cat([ids, out.response_ids], 1))
    assert torch.equal(out.attention_mask, torch.cat([mask, out.response_mask], 1))
    # Positions count real tokens only, like HF's position ids for left padding.
    full = out.attention_mask
    for r in range(ids.shape[0]):
        real = full[r].nonzero().flatten()
        assert out.position_ids[r, real].tolist() == list(range(len(real)))
        assert (out.position_ids[r][full[r] == 0] == 0).all()


def test_logprobs_match_a_full_forward_over_the_sampled_sequences(qwen2):
    """Every returned logprob equals the filtered log-softmax of a cache-free forward at that position."""
    ids, mask = left_padded(LENGTHS, seed=3)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=10, eos_token_ids=[5, 17])
    out = HFKVCacheEngine(qwen2).generate(ids, mask, params, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = qwen2(input_ids=out.sequences, attention_mask=out.attention_mask,
                       position_ids=out.position_ids).logits.double()
    P = ids.shape[1]
    for r in range(ids.shape[0]):
        for t in range(int(out.response_mask[r].sum())):
            ref = reference_logprobs(logits[r, P + t - 1].tolist(), 0.9, 40, 0.95)
            assert abs(out.logprobs[r, t].item() - ref[out.response_ids[r, t]]) < 2e-4


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (1.5, 30, 0.9)])
def test_one_step_sampling_frequencies_match_the_softmax(qwen2, temperature, top_k, top_p):
    ids, mask = left_padded([4, 6], seed=6)
    n = 3000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, n=n)
    out = HFKVCacheEngine(qwen2).generate(ids, mask, params, torch.Generator().manual_seed(1))
    with torch.no_grad():
        last = qwen2(input_ids=ids, attention_mask=mask).logits[:, -1].double()
    for i in range(ids.shape[0]):
        ref = torch.tensor(reference_logprobs(last[i].tolist(), temperature, top_k, top_p), dtype=torch.float64)
        tokens = out.response_ids[i * n:(i + 1) * n, 0]
        counts = torch.bincount(tokens, minlength=VOCAB).double()
        assert counts[torch.isinf(ref)].sum() == 0  # nothing outside top-k / top-p
        stat, df = chi_square(counts, ref.exp())
        assert df >= 10  # enough tokens in play for the check to mean something
        assert stat < chi2_critical(df), (stat, df)
        torch.testing.assert_close(out.logprobs[i * n:(i + 1) * n, 0].double(), ref[tokens], rtol=0, atol=1e-5)


def test_top_k_one_equals_greedy(qwen2):
    ids, mask = left_padded(LENGTHS, seed=7)
    engine = HFKVCacheEngine(qwen2)
    greedy = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=8))
    top1 = engine.generate(ids, mask, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=8),
                           torch.Generator().manual_seed(3))
    assert torch.equal(greedy.response_ids, top1.response_ids)
    assert torch.equal(top1.logprobs, torch.zeros_like(top1.logprobs))  # a point mass


def test_seeded_generator_gives_identical_rollouts(qwen2):
    ids, mask = left_padded(LENGTHS, seed=8)
    engine = HFKVCacheEngine(qwen2)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, eos_token_ids=[3])
    a = engine.generate(ids, mask, params, torch.Generator().manual_seed(11))
    b = engine.generate(ids, mask, params, torch.Generator().manual_seed(11))
    c = engine.generate(ids, mask, params, torch.Generator().manual_seed(12))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_n_samples_layout(qwen2):
    ids, mask = left_padded(LENGTHS, seed=9)
    engine = HFKVCacheEngine(qwen2)
    n = 3
    greedy1 = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=6))
    greedy3 = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=6, n=n))
    assert greedy3.response_ids.shape == (len(LENGTHS) * n, 6)
    assert torch.equal(greedy3.prompt_ids, ids.repeat_interleave(n, 0))
    assert torch.equal(greedy3.prompt_mask, mask.repeat_interleave(n, 0))
    assert torch.equal(greedy3.response_ids, greedy1.response_ids.repeat_interleave(n, 0))
    sampled = engine.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=6, n=n),
                              torch.Generator().manual_seed(0))
    rows = sampled.response_ids.view(len(LENGTHS), n, 6)
    assert all(len({tuple(s.tolist()) for s in rows[i]}) > 1 for i in range(len(LENGTHS)))


def _count_decode_rows(monkeypatch) -> list[int]:
    seen: list[int] = []
    original = LlamaStyleDecodeStep.__call__

    def counting(self, tokens, *args):
        seen.append(tokens.shape[0])
        return original(self, tokens, *args)

    monkeypatch.setattr(LlamaStyleDecodeStep, "__call__", counting)
    return seen


def test_finished_rows_stop_costing_compute(qwen2, monkeypatch):
    ids, mask = left_padded(LENGTHS, seed=2)
    eos = frequent_tokens(qwen2, ids, mask, 12)
    seen = _count_decode_rows(monkeypatch)
    out = HFKVCacheEngine(qwen2).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=12,
                                                                    eos_token_ids=eos))
    lengths = out.response_mask.sum(-1)
    # Decode step t feeds exactly the rows whose response is longer than t+1 tokens.
    assert seen == [int((lengths > t + 1).sum()) for t in range(len(seen))]
    assert seen[-1] < len(LENGTHS)


def test_plain_forward_path_also_drops_finished_rows(qwen2):
    ids, mask = left_padded(LENGTHS, seed=2)
    eos = frequent_tokens(qwen2, ids, mask, 12)
    seen: list[int] = []
    handle = qwen2.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        engine = HFKVCacheEngine(qwen2)
        assert "hooks" in engine.fast_decode_reason
        out = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=12, eos_token_ids=eos))
    finally:
        handle.remove()
    lengths = out.response_mask.sum(-1)
    assert seen[0] == len(LENGTHS)  # prefill
    assert seen[1:] == [int((lengths > t + 1).sum()) for t in range(len(seen) - 1)]
    assert torch.equal(out.response_ids, hf_greedy(qwen2, ids, mask, 12, eos, pad=eos[0]))


def test_checking_for_ended_rows_every_few_tokens_gives_the_same_rollout(qwen2, monkeypatch):
    """Off the CPU the host asks which rows ended only every few tokens (each ask is a device sync): rows
    that ended in between are computed but write padding, and the rollout is the one of checking every token."""
    ids, mask = left_padded(LENGTHS, seed=2)
    eos = frequent_tokens(qwen2, ids, mask, 12)
    syncs = [0]
    real_bool = torch.Tensor.__bool__

    def counting_bool(t):  # the engine's own host syncs (the model's prefill has its own)
        syncs[0] += sys._getframe(1).f_code.co_filename.endswith("hf_engine.py")
        return real_bool(t)

    def rollout(every, temperature):
        params = SamplingParams(temperature=temperature, top_k=2, max_new_tokens=12, n=2, eos_token_ids=eos,
                                pad_token_id=299)
        monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
        syncs[0] = 0
        out = HFKVCacheEngine(qwen2, eos_check_every=every).generate(ids, mask, params,
                                                                     torch.Generator().manual_seed(3))
        monkeypatch.setattr(torch.Tensor, "__bool__", real_bool)
        return out, syncs[0]

    (each, each_syncs), (lazy, lazy_syncs) = rollout(1, 0.0), rollout(5, 0.0)
    assert 0 < int(each.finished.sum()) < len(each.finished)  # some rows end early, others run to the limit
    for name in ("response_ids", "response_mask", "logprobs", "finished"):
        assert torch.equal(getattr(lazy, name), getattr(each, name)), name
    assert lazy_syncs == 12 // 5 < each_syncs
    # Sampled: each row stops at its first eos, padding and zero log-probs after it.
    sampled, _ = rollout(5, 1.0)
    hit = torch.isin(sampled.response_ids, torch.tensor(eos)) & sampled.response_mask.bool()
    assert bool(sampled.finished.any())
    assert torch.equal(sampled.finished, hit.any(-1))
    length = sampled.response_mask.sum(-1)
    assert torch.equal(length[sampled.finished], hit.long().argmax(-1)[sampled.finished] + 1)
    assert bool((sampled.response_ids[sampled.response_mask == 0] == 299).all())
    assert bool((sampled.logprobs[sampled.response_mask == 0] == 0).all())
    with pytest.raises(ConfigError, match="eos_check_every"):
        HFKVCacheEngine(qwen2, eos_check_every=0)


@pytest.mark.parametrize("every", [1, 5])
def test_rows_are_told_once_as_they_finish_with_their_final_tokens(qwen2, every):
    """`on_rows_finished` (the trainer scores a response while the others are still sampled): every row is
    told exactly once, with tokens that are already its response's, early enders before the rows that run
    to the length limit; the rollout is the same with or without the hook."""
    ids, mask = left_padded(LENGTHS, seed=2)
    eos = frequent_tokens(qwen2, ids, mask, 12)
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=12, n=2, eos_token_ids=eos, pad_token_id=299)
    engine = HFKVCacheEngine(qwen2, eos_check_every=every)
    told: list[list[tuple[int, list[int]]]] = []
    engine.on_rows_finished = lambda rows, tokens, lengths: told.append(
        [(int(r), tokens[r, : int(lengths[r])].tolist()) for r in rows])
    out = engine.generate(ids, mask, params, torch.Generator().manual_seed(3))
    rows = [r for call in told for r, _ in call]
    assert sorted(rows) == list(range(out.response_ids.shape[0]))
    for r, tokens in (item for call in told for item in call):
        assert tokens == out.response_ids[r, : int(out.response_mask[r].sum())].tolist()
    ran_to_limit = set((~out.finished).nonzero().flatten().tolist())
    assert 0 < len(ran_to_limit) < len(rows) and len(told) > 1
    assert {r for r, _ in told[-1]} >= ran_to_limit and not ran_to_limit & {r for call in told[:-1] for r, _ in call}
    engine.on_rows_finished = None
    plain = engine.generate(ids, mask, params, torch.Generator().manual_seed(3))
    assert torch.equal(plain.response_ids, out.response_ids) and torch.equal(plain.logprobs, out.logprobs)


def test_restores_training_mode():
    model = make_model("qwen2", seed=2).train()
    ids, mask = left_padded([3, 2])
    HFKVCacheEngine(model).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=2))
    assert model.training
    model.eval()
    HFKVCacheEngine(model).generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=2))
    assert not model.training


def test_rejects_right_padded_prompts(qwen2):
    ids, mask = left_padded([3, 2, 3])
    mask[1] = torch.tensor([1, 1, 0])
    with pytest.raises(DataError, match=r"row 1 is not left-padded.*padding_side = 'left'"):
        HFKVCacheEngine(qwen2).generate(ids, mask, SamplingParams())


def test_rejects_bad_inputs(qwen2):
    engine = HFKVCacheEngine(qwen2)
    ids, mask = left_padded([3, 2])
    with pytest.raises(DataError, match=r"row 1 has no real tokens"):
        engine.generate(ids, torch.tensor([[1, 1, 1], [0, 0, 0]]), SamplingParams())
    with pytest.raises(DataError, match=r"attention_mask shape \(2, 2\) does not match input_ids shape \(2, 3\)"):
        engine.generate(ids, mask[:, :2], SamplingParams())
    with pytest.raises(DataError, match=r"must be 2D"):
        engine.generate(ids[0], mask[0], SamplingParams())
    bad = ids.clone()
    bad[0, 2] = VOCAB + 5
    with pytest.raises(DataError, match=rf"token id {VOCAB + 5} at prompt row 0, column 2 is outside"):
        engine.generate(bad, mask, SamplingParams())
    with pytest.raises(ConfigError, match=r"eos_token_ids \[400\] are outside"):
        engine.generate(ids, mask, SamplingParams(eos_token_ids=[400]))
    with pytest.raises(ConfigError,
                       match=r"3 \+ max_new_tokens 126 = 129 exceeds the model's max_position_embeddings 128"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=126))
    with pytest.raises(ConfigError, match=r"takes a verl.rollout.SamplingParams"):
        engine.generate(ids, mask, {"temperature": 1.0})


def test_pad_positions_may_hold_any_id(qwen2):
    ids, mask = left_padded([4, 2], seed=1)
    odd = ids.masked_fill(mask == 0, -100)
    engine = HFKVCacheEngine(qwen2)
    a = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=4))
    b = engine.generate(odd, mask, SamplingParams(temperature=0, max_new_tokens=4))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(b.prompt_ids, odd)


def test_shared_prefill_samples_the_same_tokens_as_prefilling_every_copy(qwen2):
    """n samples per prompt prefill each prompt once and repeat its cache; under one seed that samples
    exactly what prefilling the n copies separately samples."""
    ids, mask = left_padded(LENGTHS, seed=4)
    engine = HFKVCacheEngine(qwen2)
    n = 3
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=n)
    shared = engine.generate(ids, mask, params, torch.Generator().manual_seed(5))
    copies = engine.generate(ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0),
                             SamplingParams(temperature=1.0, max_new_tokens=8, n=1), torch.Generator().manual_seed(5))
    assert torch.equal(shared.response_ids, copies.response_ids)
    assert torch.equal(shared.response_mask, copies.response_mask)
    assert torch.allclose(shared.logprobs, copies.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fast_decode", [True, False])
def test_weights_changed_between_tokens_sample_the_rest(fast_decode):
    """A partial rollout: `between_tokens` swaps in other weights after token 2. Tokens 0-2 are the old
    weights' greedy tokens; from token 3 on, each is the new weights' argmax over a cache the old weights
    wrote for the prompt and tokens 0-1 (transformers' own cached forward is the reference)."""
    old, new = make_model(seed=0), make_model(seed=1)
    engine = HFKVCacheEngine(make_model(seed=0), fast_decode=fast_decode)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    unchanged = engine.generate(ids, mask, params)

    def swap(step: int) -> bool:
        if step != 2:
            return False
        engine.model.load_state_dict(new.state_dict())
        return True

    engine.between_tokens = swap
    out = engine.generate(ids, mask, params)
    assert torch.equal(out.response_ids[:, :3], unchanged.response_ids[:, :3])
    assert not torch.equal(out.response_ids[:, 3:], unchanged.response_ids[:, 3:])
    with torch.no_grad():
        cache = old(input_ids=torch.cat([ids, out.response_ids[:, :2]], 1), use_cache=True).past_key_values
        logits = new(input_ids=out.response_ids[:, 2:-1], cache=cache).logits.double()
    assert torch.equal(logits.argmax(-1), out.response_ids[:, 3:])
    assert torch.allclose(logits.log_softmax(-1).gather(-1, out.response_ids[:, 3:, None])[..., 0],
                          out.logprobs[:, 3:].double(), atol=2e-4)
