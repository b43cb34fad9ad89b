"""Multi-turn rollout: masks, log-prob equality with one forward over the episode, KV-cache continuation
against a fresh prefill, max_turns / budget truncation, early-ending episodes leaving the batch, env errors."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_support import load_tiny

from verl.env.calculator import CalculatorEnv, evaluate_expression
from verl.env.multiturn import Done, MultiTurnEnv, Observation
from verl.errors import ConfigError, EnvError
from verl.rollout import HFKVCacheEngine, SamplingParams
from verl.rollout.multiturn import MultiTurnRollout
from verl.trainer.forward.logprobs import response_logprobs
from verl.utils.positions import position_ids_from_mask

# Frequent characters as stop strings: a random model's turns then end at varied lengths.
STOP = ["e", "a"]


@pytest.fixture(scope="module")
def tiny():
    """The base tiny model, left-padded, in eval mode (tests/tiny_support.py)."""
    return load_tiny("base", padding_side="left", eval_mode=True)


class ScriptedEnv(MultiTurnEnv):
    """Observations of a different length per row and turn; Done after `done_after` turns (None: never)."""

    def __init__(self, done_after=3, obs_len=lambda row, turn: 1 + (row * 3 + turn * 2) % 7, max_turns=4,
                 max_episode_tokens=200, fail=None):
        rows = [{"prompt": p, "ground_truth": str(i), "data_source": "s", "metadata": {"i": i}}
                for i, p in enumerate(["12*3=", "Hello there,", "7", "a b c d e f g"])]
        super().__init__(rows, max_turns=max_turns, max_episode_tokens=max_episode_tokens)
        self.done_after, self.obs_len, self.fail = done_after, obs_len, fail

    def start(self, row):
        return row["prompt"], {"i": row["metadata"]["i"], "turn": 0, "texts": []}

    def step(self, state, model_text):
        state["turn"] += 1
        state["texts"].append(model_text)
        if self.fail is not None and (state["i"], state["turn"]) == self.fail[:2]:
            return self.fail[2](state)
        if self.done_after is not None and state["turn"] >= self.done_after + state["i"] % 2:
            return Done(reward=float(state["i"]) + 0.5 * state["turn"], tool_call=True,
                        info={"odd": state["i"] % 2 == 1, "note": "not a number"})
        return Observation(" <r>" + "x" * self.obs_len(state["i"], state["turn"]) + "</r>", tool_call=True,
                           tool_error=state["turn"] == 2)


def _rollout(tiny, env, n=2, temperature=1.0, max_new=6, seed=0, stop=STOP):
    model, tok = tiny
    runner = MultiTurnRollout(HFKVCacheEngine(model), tok, stop)
    prompts, records = runner.start(env, env.val_rows() or env.get_batch(4), n)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)
    out = runner.run(env, records, enc["input_ids"], enc["attention_mask"], params,
                     generator=torch.Generator().manual_seed(seed))
    return runner, out


def _env_with_val(**kw):
    env = ScriptedEnv(**kw)
    env._val = list(env._train)  # the four rows in a fixed order
    return env


def test_masks_cover_model_tokens_only_and_logprobs_equal_one_forward(tiny):
    model, tok = tiny
    env = _env_with_val()
    _, out = _rollout(tiny, env, seed=1)  # a seed where every episode's first turn writes a stop string
    assert out.episodes and max(e.turns for e in out.episodes) >= 3
    for i, e in enumerate(out.episodes):
        k = len(e.tokens)
        assert out.response_attention_mask[i, :k].all() and not out.response_attention_mask[i, k:].any()
        # The observation tokens are exactly the environment's texts, tokenised, with mask 0.
        obs = [t for t, m in zip(e.tokens, e.loss_mask, strict=True) if m == 0]
        expected = sum((tok(text, add_special_tokens=False)["input_ids"] for who, text in e.transcript
                        if who == "env"), [])
        assert obs == expected and len(obs) > 0
        assert out.response_mask[i, :k].tolist() == e.loss_mask and not out.response_mask[i, k:].any()
        assert (out.logprobs[i][out.response_mask[i] == 0] == 0).all()
    assert_one_forward_logprobs(model, out)
    # Rewards and metrics come from the episodes.
    assert out.rewards.tolist() == [e.reward for e in out.episodes]
    metrics = out.metrics()
    assert metrics["episode/tool_calls_mean"] == sum(e.tool_calls for e in out.episodes) / len(out.episodes)
    assert metrics["episode/tool_errors_mean"] > 0
    assert metrics["episode/odd"] == sum(e.info.get("odd", 0) for e in out.episodes) / len(out.episodes)
    assert "episode/note" not in metrics  # only numbers from Done.info become metrics


def _reference_episode(model, tok, env, row, max_new, budget, max_turns, stop):
    """Greedy episode with a fresh full forward for every token (no cache): what the KV cache must equal."""
    prompt, state = env.start(row)
    seq = tok(prompt, add_special_tokens=False)["input_ids"]
    plen = len(seq)
    for turn in range(1, max_turns + 1):
        turn_tokens, reason = [], ""
        for step in range(max_new):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            t = int(logits.argmax())
            seq.append(t)
            turn_tokens.append(t)
            text = tok.decode(turn_tokens)
            if t == tok.eos_token_id or any(s in text for s in stop):
                reason = "env"
            elif len(seq) - plen >= budget or step == max_new - 1:
                reason = "truncated"
            if reason:
                break
        if reason == "truncated":
            return seq[plen:]
        answer = env.step(state, tok.decode(turn_tokens, skip_special_tokens=True))
        if isinstance(answer, Done) or turn == max_turns:
            return seq[plen:]
        obs = tok(answer.text, add_special_tokens=False)["input_ids"]
        if len(seq) - plen + len(obs) >= budget:
            return seq[plen:]
        seq += obs
    return seq[plen:]


def test_kv_cache_continuation_equals_fresh_prefill(tiny):
    model, tok = tiny
    stop = ["==", ",,", "77", " g g", "e", "a"]  # greedy text of the random model repeats itself
    _, out = _rollout(tiny, _env_with_val(), n=1, temperature=0.0, stop=stop)
    ref_env = _env_with_val()
    for i, row in enumerate(ref_env.val_rows()):
        expected = _reference_episode(model, tok, ref_env, row, 6, 200, 4, stop)
        assert out.episodes[i].tokens == expected, f"episode {i}"
    assert any(e.turns > 1 for e in out.episodes)


def test_max_turns_truncates_and_scores_with_truncated_reward(tiny):
    env = _env_with_val(done_after=None, max_turns=2)
    env.truncated_reward = lambda state: -1.0
    _, out = _rollout(tiny, env, max_new=40)  # long enough for a stop string in every turn
    ended = [e for e in out.episodes if e.truncated not in ("max_new_tokens", "budget")]
    assert ended and all(e.truncated == "max_turns" and e.turns == 2 for e in ended)
    assert all(e.reward == -1.0 and not e.finished for e in out.episodes)
    assert not out.finished.any()
    # The last observation (which would have needed a third turn) is not appended.
    assert all(sum(1 for who, _ in e.transcript if who == "env") == 2 for e in ended)
    assert all(e.loss_mask.count(0) == len(tiny[1](e.transcript[1][1], add_special_tokens=False)["input_ids"])
               for e in ended)


def test_observation_over_budget_ends_the_episode_truncated(tiny):
    env = _env_with_val(done_after=None, obs_len=lambda row, turn: 30, max_turns=4, max_episode_tokens=40)
    _, out = _rollout(tiny, env, max_new=40)
    assert all(e.truncated in ("budget", "max_new_tokens") for e in out.episodes)
    assert any(e.truncated == "budget" for e in out.episodes)
    assert all(len(e.tokens) <= 40 for e in out.episodes)
    assert out.response_ids.shape[1] <= 40


def _spied_rollout(tiny, env, stop, temperature, parks=True, n=1, fast=False):
    """A rollout that records the rows of every decode call (one new token per row) on the plain forward
    path (`fast`: the lean decode step, whose calls are not counted)."""
    model, tok = tiny
    runner = MultiTurnRollout(HFKVCacheEngine(model, fast_decode=fast), tok, stop)
    assert (runner.engine.fast_decode_reason == "") == (fast and parks)
    runner.engine.preallocates = parks  # False: the model's own cache, where rows that sat out keep holes
    decoded = []
    real = runner.engine._forward

    def spy(ids, mask, positions, cache):
        if ids.shape[1] == 1:
            decoded.append(ids.shape[0])
        return real(ids, mask, positions, cache)

    runner.engine._forward = spy
    prompts, records = runner.start(env, env.val_rows(), n)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)
    out = runner.run(env, records, enc["input_ids"], enc["attention_mask"], params,
                     generator=torch.Generator().manual_seed(1))
    return out, decoded


def test_ended_turns_and_episodes_are_not_decoded(tiny):
    model, tok = tiny
    stop = ["===", ",,,,", "77777", " g g", ">>>"]  # the greedy turns of the random model end after 2-5 tokens
    env = _env_with_val(done_after=1)  # even rows end after turn 1, odd rows after turn 2
    out, decoded = _spied_rollout(tiny, env, stop, temperature=0.0)
    eps = out.episodes
    assert len({len(e.tokens) for e in eps}) > 1 and any(e.turns == 2 for e in eps) and any(e.turns == 1 for e in eps)
    # Every model token but a turn's last (fed with the observation that follows it) is decoded exactly once,
    # so no decode step computes a row whose turn (or episode) is over.
    assert sum(decoded) == sum(sum(e.loss_mask) - e.turns for e in eps)
    assert decoded[:4] == [4, 3, 2, 1]  # turn 1: rows leave the decode batch as their turns end
    # ... and the tokens are those of a fresh forward over each episode alone.
    ref_env = _env_with_val(done_after=1)
    for i, row in enumerate(ref_env.val_rows()):
        assert eps[i].tokens == _reference_episode(model, tok, ref_env, row, 12, 200, 4, stop), f"episode {i}"
    # Without parking (a cache layout it does not handle) rows that sat out are fed holes: same tokens.
    held, held_decoded = _spied_rollout(tiny, _env_with_val(done_after=1), stop, temperature=0.0, parks=False)
    assert [e.tokens for e in held.episodes] == [e.tokens for e in eps]
    assert sum(held_decoded) > sum(decoded)
    # The lean decode step of single-turn rollouts writes the same episodes.
    quick, _ = _spied_rollout(tiny, _env_with_val(done_after=1), stop, temperature=0.0, fast=True)
    assert [e.tokens for e in quick.episodes] == [e.tokens for e in eps]


def assert_one_forward_logprobs(model, out):
    """The trainer's forward over the compact episodes gives the sampler's log-probs on model tokens."""
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_attention_mask], 1)
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, mask, position_ids_from_mask(mask), out.response_ids.shape[1])
    m = out.response_mask.bool()
    assert torch.allclose(lp[m], out.logprobs[m], atol=1e-5)


def test_sampled_episodes_with_parked_rows_keep_one_forward_logprobs(tiny):
    model, _ = tiny
    out, decoded = _spied_rollout(tiny, _env_with_val(), STOP, temperature=1.0, n=2)
    assert sum(decoded) == sum(sum(e.loss_mask) - e.turns for e in out.episodes)
    assert max(e.turns for e in out.episodes) >= 3
    assert_one_forward_logprobs(model, out)


def _raise(state):
    raise KeyError("no tool named 'calc2'")


@pytest.mark.parametrize(("answer", "match"), [
    (_raise, r"environment ScriptedEnv raised KeyError: .*no tool named 'calc2'.* in step\(\) at turn 2 of the "
             r"episode of row 1 of the batch, prompt 'Hello there,'"),
    (lambda state: "42", r"ScriptedEnv.step\(\) returned str at turn 2 of the episode of row 1 .*"
                         r"verl.env.Observation\(text\) to continue or verl.env.Done\(reward\)"),
    (lambda state: Done(reward=math.nan), r"returned Done\(reward=nan\) at turn 2 of the episode of row 1"),
    (lambda state: Observation(text=7), r"Observation\(text=int\) at turn 2 .* must be a string"),
])
def test_env_errors_name_the_env_the_row_and_the_turn(tiny, answer, match):
    env = _env_with_val(done_after=None, fail=(1, 2, answer))
    with pytest.raises(EnvError, match=match):
        _rollout(tiny, env, n=1, max_new=40)


def test_env_start_errors_and_engine_requirements(tiny):
    model, tok = tiny
    env = _env_with_val()
    env.start = lambda row: (_ for _ in ()).throw(ValueError("bad row"))
    runner = MultiTurnRollout(HFKVCacheEngine(model), tok, STOP)
    with pytest.raises(EnvError, match=r"ScriptedEnv raised ValueError: bad row in start\(\) at the start of the "
                                       r"episode of row 0 of the batch"):
        runner.start(env, env.val_rows(), 1)
    env.start = lambda row: "only a prompt"
    with pytest.raises(EnvError, match=r"start\(\) returned str .* \(first messages, episode state\)"):
        runner.start(env, env.val_rows(), 1)
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        MultiTurnRollout(object(), tok, STOP)
    with pytest.raises(ConfigError, match="non-empty strings"):
        MultiTurnRollout(HFKVCacheEngine(model), tok, [""])
    with pytest.raises(ConfigError, match="max_turns .* must be an int >= 1, got 0"):
        ScriptedEnv(max_turns=0)
    env = _env_with_val(max_episode_tokens=5000)
    with pytest.raises(ConfigError, match=r"episode budget 5000 \(ScriptedEnv.max_episode_tokens\) .* exceeds the "
                                          r"model's max_position_embeddings 1024"):
        _rollout(tiny, env)


def test_calculator_env_answers_calls_and_scores_malformed_ones():
    assert evaluate_expression("347*29") == 10063
    assert evaluate_expression(" 2+3*4-5 ") == 9 and evaluate_expression("5-3") == 2
    assert evaluate_expression("2**3") is None and evaluate_expression("import os") is None
    env = CalculatorEnv(num_train=10, num_val=2)
    row = env.val_rows()[0]
    prompt, state = env.start(row)
    a, b = row["metadata"]["a"], row["metadata"]["b"]
    assert prompt == f"{a}*{b}="
    obs = env.step(state, f"<calc>{a}*{b}</calc>")
    assert obs == Observation(f" <result>{a * b}</result>", tool_call=True)
    bad = env.step(state, "<calc>what is it</calc>")  # a malformed call is answered, not raised
    assert bad.tool_error and bad.text == " <result>error</result>"
    done = env.step(state, f" {a * b}")
    assert isinstance(done, Done) and done.reward == 1.0
    assert done.info == {"correct": True, "tool_calls": 2, "correct_calls": 1}
    assert env.step(env.start(row)[1], " 12").reward == 0.0
    # Partial credit: a wrong answer earns partial_credit x the share of the product's digits in place.
    shaped = CalculatorEnv(num_train=10, num_val=2, partial_credit=0.5)
    product = str(a * b)
    near = product[:-1] + str((int(product[-1]) + 1) % 10)  # the last digit wrong
    done = shaped.step(shaped.start(row)[1], f" {near}")
    assert done.reward == pytest.approx(0.5 * (len(product) - 1) / len(product)) and done.info["correct"] is False
    assert shaped.step(shaped.start(row)[1], " no number").reward == 0.0
    with pytest.raises(ConfigError, match=r"partial_credit must be in \[0, 1\)"):
        CalculatorEnv(partial_credit=1.0)
