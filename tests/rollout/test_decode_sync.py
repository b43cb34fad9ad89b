"""Decoding with an `end` callback (multi-turn stop strings, the episode budget) asks the host which rows ended
only every `eos_check_every` tokens, as the eos path does: the same tokens, log-probs, lengths, ended rows,
`end` calls and KV cache as asking every token, with about k times fewer host syncs."""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
from tiny_support import load_tiny
from torch.overrides import TorchFunctionMode

from tests.rollout.conftest import left_padded
from tests.rollout.test_multiturn import STOP, _env_with_val, assert_one_forward_logprobs
from verl.rollout import HFKVCacheEngine, SamplingParams
from verl.rollout import hf_engine as hf_engine_module
from verl.rollout.multiturn import MultiTurnRollout

LENGTHS = [7, 3, 5, 1, 6, 2]
LEFT_PAD_COLUMNS = max(LENGTHS)  # the prompt's columns (left padding included): the prefill's, not the decode's
STEPS = 24


class SyncCounter(TorchFunctionMode):
    """Counts the engine's reads of tensor values on the host (each a device sync off the CPU) while it is active
    (`with SyncCounter(monkeypatch) as counter:`): its `_to_host`, and bool()/int()/float()/item()/tolist()/
    nonzero()/cpu() and boolean-mask indexing called from hf_engine.py. On CPU nothing syncs, so this counts
    where a GPU run would. A torch-function mode, not patched Tensor methods: assigning `Tensor.__getitem__` leaves
    CPython's sequence slot on the class after it is restored, and `torch.tensor([a 0-d tensor])` then fails in
    every later test of the process."""

    METHODS = ("__bool__", "__int__", "__float__", "item", "tolist", "nonzero", "cpu", "numpy")

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        self.host_reads = 0
        real_to_host = hf_engine_module._to_host

        def to_host(t):
            self.host_reads += 1
            self.count += 1
            return real_to_host(t)

        monkeypatch.setattr(hf_engine_module, "_to_host", to_host)

    @staticmethod
    def _from_engine() -> bool:  # _HostEnds works on the host's copies (CPU tensors, lists) only
        frame = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: the tensor method's caller
        return (frame.f_code.co_filename.endswith("hf_engine.py")
                and frame.f_code.co_name not in ("to_host", "_to_host", "settle"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.METHODS and self._from_engine() and args[0].device.type != "meta":
            self.count += 1
        elif name in ("__getitem__", "__setitem__") and self._from_engine():
            parts = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.count += 1  # a boolean mask as an index: a nonzero on the device
        return func(*args, **(kwargs or {}))


def every_kth_token_end(period: int):
    """Rows end when their token is a multiple of `period`, or at row-dependent steps: rows end at varied steps,
    several inside one window of k tokens. Records every call."""
    calls: list[tuple[list[int], int]] = []

    def end(rows, step, tokens):
        assert rows.device.type == "cpu" and tokens.device.type == "cpu" and tokens.shape[1] == step + 1
        calls.append((rows.tolist(), step))
        return (tokens[rows, step] % period == 0) | (rows * 5 + 3 == step)

    return end, calls


def _decode(model, every, temperature, keep=True, parks=True, told=None, steps=STEPS, period=11, eos=None):
    if eos is None:  # a token the longest row writes mid-way: some rows end at it, others by `end` first
        free, _, _, _ = _decode(model, 1, temperature, keep=False, steps=steps, period=period, eos=())
        longest = int(free.lengths.argmax())
        eos = [int(free.tokens[longest, int(free.lengths[longest]) // 2])]
    engine = HFKVCacheEngine(model, eos_check_every=every)
    engine.preallocates = parks
    ids, mask = left_padded(LENGTHS, seed=4)
    params = SamplingParams(temperature=temperature, top_k=50, max_new_tokens=steps, eos_token_ids=list(eos),
                            pad_token_id=299)
    end, calls = every_kth_token_end(period)
    generator = torch.Generator().manual_seed(5)
    finished = None if told is None else (lambda rows, tokens, lengths: told.append(
        [(int(r), tokens[r, : int(lengths[r])].tolist()) for r in rows]))
    with torch.inference_mode():
        state = engine.prefill(ids, mask, ids.shape[1] + 2 * steps + 8)
        out = engine.decode(state, params, steps, generator, keep=keep, end=end, finished=finished)
        more = None
        if keep:  # the next turn: feed each row's last token and two more, then decode on the same cache
            last = out.tokens.gather(1, (out.lengths - 1).unsqueeze(1))
            block = torch.cat([last, torch.full_like(last, 17), torch.full_like(last, 23)], 1)
            engine.extend(state, block, torch.ones_like(block, dtype=torch.bool))
            more = engine.decode(state, params, 8, generator, keep=True, end=end)
    return out, calls, state, more


# Rows that ended are computed on until the check, so the batch the others share a step with is larger. CPU and
# GPU matmul kernels round differently for different batch sizes (on this CPU x[:3] @ w differs in the last bit
# from (x @ w)[:3]), as they do when the every-token decode drops a row: log-probs and the cache agree to
# float rounding; tokens, lengths, ends and the questions asked of `end` are equal.
ROUNDING = dict(atol=1e-5, rtol=0)


def _same(a, b):
    for name in ("tokens", "lengths", "eos"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.logprobs, b.logprobs, **ROUNDING)
    assert torch.equal(a.logprobs == 0, b.logprobs == 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("every", [3, 8])
def test_end_checked_every_k_tokens_gives_the_decode_of_checking_every_token(qwen2, temperature, every):
    each, each_calls, each_state, each_more = _decode(qwen2, 1, temperature)
    lazy, lazy_calls, lazy_state, lazy_more = _decode(qwen2, every, temperature)
    _same(lazy, each)
    assert lazy_calls == each_calls  # `end` is asked the same questions, about the same rows, a window late
    ended = each.lengths.tolist()
    assert bool(each.eos.any()) and any(n < STEPS for n, e in zip(ended, each.eos.tolist(), strict=True) if not e)
    # Rows end at different steps inside one window of k tokens (and others after it).
    windows = {}
    for n in ended:
        if n < STEPS:
            windows.setdefault((n - 1) // every, set()).add(n)
    assert any(len(steps) > 1 for steps in windows.values()), ended
    # Padding and log-prob 0 after each row's end, as if never sampled.
    after = torch.arange(STEPS) >= each.lengths.unsqueeze(1)
    assert bool((lazy.tokens[after] == 299).all()) and bool((lazy.logprobs[after] == 0).all())
    # The state handed back is the same: mask, positions and every cache column, so later turns are too.
    assert torch.equal(lazy_state.mask, each_state.mask) and torch.equal(lazy_state.next_pos, each_state.next_pos)
    for a, b in zip(lazy_state.cache.layers, each_state.cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape
        assert torch.allclose(a.keys, b.keys, **ROUNDING) and torch.allclose(a.values, b.values, **ROUNDING)
        # Where a row sat out (past its end) the cache holds zeros, as in the every-token decode's.
        hole = ~each_state.mask[:, None, :, None].expand_as(b.keys)
        hole[..., : LEFT_PAD_COLUMNS, :] = False
        assert bool((a.keys[hole] == 0).all()) and bool((a.values[hole] == 0).all())
    _same(lazy_more, each_more)


@pytest.mark.parametrize("every", [1, 5])
def test_without_keep_and_with_finished_rows_told_once(qwen2, every):
    told: list = []
    out, _, _, _ = _decode(qwen2, every, 1.0, keep=False, told=told)
    reference, _, _, _ = _decode(qwen2, 1, 1.0, keep=False)
    _same(out, reference)
    rows = [r for call in told for r, _ in call]
    assert sorted(rows) == list(range(len(LENGTHS)))
    for r, tokens in (item for call in told for item in call):
        assert tokens == out.tokens[r, : int(out.lengths[r])].tolist()


def test_a_model_layout_cache_checks_every_token_with_the_same_decode(qwen2, monkeypatch):
    """Rows that sat out feed masked holes on a model-layout cache, which keeps every column it is fed: that
    path keeps checking every token (eos_check_every does not apply) and writes the same decode."""
    parked, _, _, _ = _decode(qwen2, 1, 0.0)
    with SyncCounter(monkeypatch) as counter:
        held, _, _, _ = _decode(qwen2, 8, 0.0, parks=False)
    _same(held, parked)
    assert counter.host_reads >= int(held.lengths.max())


def test_host_syncs_drop_by_about_k(qwen2, monkeypatch):
    counts = {}
    for every in (1, 8):
        with SyncCounter(monkeypatch) as counter:
            out, _, _, _ = _decode(qwen2, every, 1.0, keep=True, period=29, eos=(7,))
        monkeypatch.undo()
        counts[every] = counter.count, counter.host_reads
        ran = int(out.lengths.max())
    (each, each_reads), (lazy, lazy_reads) = counts[1], counts[8]
    # Decode of STEPS tokens twice (the second on 8 tokens): one host read per token, or per 8 tokens.
    assert each_reads == ran + 8 and lazy_reads == math.ceil(ran / 8) + 1
    # Everything else the engine reads on the host is per decode, not per token (or at a check with ended rows).
    assert lazy <= lazy_reads + 8 and each >= ran + 8
    assert each / lazy >= 3, counts
    print(f"host syncs: {each} with a check every token, {lazy} every 8 tokens ({ran} + 8 decode steps)")


@pytest.fixture(scope="module")
def tiny():
    return load_tiny("base", padding_side="left", eval_mode=True)


def _episodes(tiny, every, temperature, seed=1, env=None, stop=STOP, max_new=12, monkeypatch=None):
    model, tok = tiny
    runner = MultiTurnRollout(HFKVCacheEngine(model, eos_check_every=every), tok, stop)
    env = env or _env_with_val()
    counter = SyncCounter(monkeypatch) if monkeypatch is not None else None
    prompts, records = runner.start(env, env.val_rows(), 2)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)
    with counter if counter is not None else contextlib.nullcontext():
        out = runner.run(env, records, enc["input_ids"], enc["attention_mask"], params,
                         generator=torch.Generator().manual_seed(seed))
    if monkeypatch is not None:
        monkeypatch.undo()
    return out, counter


def _same_episodes(a, b):
    for name in ("prompt_ids", "response_ids", "response_mask", "response_attention_mask", "finished", "rewards"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.logprobs, b.logprobs, **ROUNDING)
    for x, y in zip(a.episodes, b.episodes, strict=True):
        assert (x.tokens, x.turns, x.truncated, x.transcript) == (y.tokens, y.turns, y.truncated, y.transcript)


GREEDY_STOP = ["===", ",,,,", "77777", " g g", ">>>"]  # the greedy turns of the random model end after 2-5 tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multiturn_episodes_are_the_same_with_checks_every_8_tokens(tiny, temperature, monkeypatch):
    stop = GREEDY_STOP if temperature == 0 else STOP
    each, each_count = _episodes(tiny, 1, temperature, stop=stop, monkeypatch=monkeypatch)
    lazy, lazy_count = _episodes(tiny, 8, temperature, stop=stop, monkeypatch=monkeypatch)
    _same_episodes(lazy, each)
    assert len({e.turns for e in each.episodes}) > 1 and max(e.turns for e in each.episodes) >= 3
    assert_one_forward_logprobs(tiny[0], lazy)
    model_tokens = sum(sum(e.loss_mask) for e in each.episodes)
    assert each_count.host_reads <= model_tokens  # one per decode step (rows share a step)
    # One per 8 steps of a turn's decode; the rest (a few per turn: the episodes' bookkeeping) does not change.
    turns = max(e.turns for e in each.episodes)
    assert lazy_count.host_reads <= math.ceil(each_count.host_reads / 8) + turns
    assert each_count.count - lazy_count.count >= each_count.host_reads - lazy_count.host_reads
    print(f"temperature {temperature}: host reads {each_count.host_reads} -> {lazy_count.host_reads}, all syncs "
          f"{each_count.count} -> {lazy_count.count}, for {model_tokens} model tokens")


def test_episodes_that_run_into_the_budget_are_the_same(tiny):
    """The budget ends turns mid-window at row-dependent steps (rows have written different amounts)."""
    def env():
        return _env_with_val(done_after=None, obs_len=lambda row, turn: 1 + row * 3, max_turns=6,
                             max_episode_tokens=30)

    each, _ = _episodes(tiny, 1, 1.0, env=env(), stop=["e"], max_new=20)
    lazy, _ = _episodes(tiny, 8, 1.0, env=env(), stop=["e"], max_new=20)
    _same_episodes(lazy, each)
    assert any(e.truncated == "budget" for e in each.episodes)


def test_tool_env_episodes_are_the_same(monkeypatch):
    from tests.env.test_tool_env import _env
    from verl.data.chat import encode_prompt
    from verl.data.tool_template import HERMES_TEMPLATE

    model, tok = load_tiny(padding_side="left", chat_template=HERMES_TEMPLATE)

    def run(every):
        env = _env(tool_call_format="test_e_calls")  # a turn with an "e" calls the tool
        env.bind_tokenizer(tok)
        runner = MultiTurnRollout(HFKVCacheEngine(model.eval(), eos_check_every=every), tok, stop=["e", "a"])
        prompts, records = runner.start(env, env.get_batch(4), 2)
        ids = [encode_prompt(tok, p, "auto", {"tools": env.tool_schemas}) for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=[tok.eos_token_id],
                                pad_token_id=tok.pad_token_id)
        return runner.run(env, records, input_ids, mask, params, generator=torch.Generator().manual_seed(0))

    each, lazy = run(1), run(8)
    _same_episodes(lazy, each)
    assert each.metrics()["episode/tool_calls_mean"] > 0
