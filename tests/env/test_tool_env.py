"""Chat-template tool use (`ToolEnv`): schemas checked at start, calls run or answered with errors, the tool
turn taken from the template, and episodes whose log-probs equal one forward over the stitched tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_support import load_tiny

from tests.rollout.test_multiturn import assert_one_forward_logprobs
from verl.data.chat import encode_prompt
from verl.data.tool_parsers import ParsedTurn, ToolCall, register_tool_call_format
from verl.data.tool_template import HERMES_TEMPLATE, ToolTurns, prefix_preserving
from verl.env.multiturn import Done, Observation
from verl.env.tool_env import ToolEnv
from verl.env.tools import Tool, check_tools
from verl.errors import ConfigError
from verl.models.tiny import build_tiny_model
from verl.rollout import HFKVCacheEngine, SamplingParams
from verl.rollout.multiturn import MultiTurnRollout

EXPR = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 20}},
        "required": ["expression"], "additionalProperties": False}


def _evaluate(expression: str) -> int:
    a, b = expression.split("*")
    return int(a) * int(b)


CALCULATOR = Tool("calculator", "Multiply two integers, e.g. 12*3.", EXPR, _evaluate)


class Products(ToolEnv):
    def score(self, row, answer):
        return float(answer.strip().endswith(row["ground_truth"]))


def _env(**kw):
    rows = [{"prompt": f"{a}*{b}=", "ground_truth": str(a * b)} for a, b in ((12, 3), (7, 8), (21, 4), (5, 5))]
    return Products(rows, tools=[CALCULATOR], max_turns=3, max_episode_tokens=120, **kw)


@pytest.fixture(scope="module")
def tiny():
    """The tiny instruct model, left-padded, with the Hermes tool template, in eval mode (tests/tiny_support.py)."""
    return load_tiny(padding_side="left", chat_template=HERMES_TEMPLATE, eval_mode=True)


def test_schemas_are_checked_when_the_environment_is_built():
    bad = Tool("calculator", "x", {"type": "object", "properties": {"expression": {"type": "strng"}}}, _evaluate)
    with pytest.raises(ConfigError, match="tool 'calculator': parameters is not a valid JSON schema at "
                                          "properties/expression/type"):
        _env().__class__([{"prompt": "1*1="}], tools=[bad])
    with pytest.raises(ConfigError, match="parameters must be a JSON schema of type 'object'"):
        check_tools([Tool("t", "x", {"type": "string"}, str)], "Env")
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        check_tools([CALCULATOR, CALCULATOR], "Env")
    with pytest.raises(ConfigError, match="unknown tool-call format"):
        _env(tool_call_format="chatml")


def test_calls_are_run_and_every_kind_of_bad_call_is_an_error_result(tiny):
    env = _env()
    env.bind_tokenizer(tiny[1])
    row = env.get_batch(1)[0]
    state = env.start(row)[1]
    ok = env.step(state, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>')
    assert isinstance(ok, Observation) and ok.tool_call and not ok.tool_error
    assert "<tool_response>\n36\n</tool_response>" in ok.text and ok.text.endswith("<|im_start|>assistant\n")
    for text, says in [
        ("<tool_call>{oops</tool_call>", "error: the tool call is not valid JSON"),
        ('<tool_call>{"name": "calculater", "arguments": {"expression": "1*2"}}</tool_call>',
         "error: no tool named 'calculater'; the tools are calculator. Did you mean 'calculator'?"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1*2"}}</tool_call>',
         "error: calculator arguments: 'expression' is a required property"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
         "error: calculator raised ValueError"),
    ]:
        answer = env.step(state, text)
        assert isinstance(answer, Observation) and answer.tool_error and says in answer.text, answer.text
    many = env.step(state, "".join('<tool_call>{"name": "calculator", "arguments": {"expression": "2*2"}}'
                                   "</tool_call>" for _ in range(6)))
    assert "2 more call(s) in this turn were not run: at most 4" in many.text and many.tool_error
    done = env.step(state, f"The answer is {row['ground_truth']}")
    assert isinstance(done, Done) and done.reward == 1.0
    assert done.info == {"calls": 1 + 4 + 4, "call_errors": 4 + 1}


def test_the_prompt_lists_the_tools_and_a_template_without_them_is_refused(tiny):
    _, tok = tiny
    env = _env()
    ids = encode_prompt(tok, [{"role": "user", "content": "12*3="}], "auto", {"tools": env.tool_schemas})
    text = tok.decode(ids)
    assert "<tools>" in text and '"name": "calculator"' in text and text.endswith("<|im_start|>assistant\n")
    plain = load_tiny()[1]  # ChatML, no tools
    with pytest.raises(ConfigError, match="environment Products: the chat template has no tool section"):
        env.bind_tokenizer(plain)


THINKING = HERMES_TEMPLATE.replace(  # drops the <think> block of every assistant turn but the last, as Qwen3 does
    "{{ message.content or '' }}",
    "{{ (message.content or '').split('</think>')[-1] if not loop.last else (message.content or '') }}")


def test_prefix_preservation_probe_on_two_templates(tiny):
    _, tok = tiny
    tools = _env().tool_schemas
    assert prefix_preserving(tok, tools)[0]
    thinking = type(tok).from_pretrained(build_tiny_model())
    thinking.chat_template = THINKING
    ok, why = prefix_preserving(thinking, tools)
    assert not ok and "turn 5 (user)" in why and "token-level" in why
    ToolTurns(thinking, tools)  # the tool turn itself is still found: episodes do not re-render
    with pytest.warns(UserWarning, match="Products: the chat template is not prefix-preserving: adding turn 5"):
        _env().bind_tokenizer(thinking)


register_tool_call_format(  # a random model never writes <tool_call>: any turn with an "e" calls the tool
    "test_e_calls", lambda text: ParsedTurn(text, [ToolCall("calculator", {"expression": "6*7"})] if "e" in text
                                            else []), lambda calls, content="": content)


def test_episodes_append_the_template_tool_turn_as_tokens_and_keep_one_forward_logprobs(tiny):
    model, tok = tiny
    env = _env(tool_call_format="test_e_calls")
    env.bind_tokenizer(tok)
    runner = MultiTurnRollout(HFKVCacheEngine(model), tok, stop=["e", "a"])
    rows = env.get_batch(4)
    prompts, records = runner.start(env, rows, 2)
    ids = [encode_prompt(tok, p, "auto", {"tools": env.tool_schemas}) for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    params = SamplingParams(temperature=1.0, max_new_tokens=6, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)
    out = runner.run(env, records, input_ids, mask, params, generator=torch.Generator().manual_seed(0))
    observed = 0
    for e in out.episodes:
        obs = [t for t, m in zip(e.tokens, e.loss_mask, strict=True) if m == 0]
        texts = [text for who, text in e.transcript if who == "env"]
        if e.truncated and e.transcript[-1][0] == "env":  # the answer to the last turn had no room: not appended
            texts = texts[:-1]
        assert obs == sum((tok(text, add_special_tokens=False)["input_ids"] for text in texts), [])
        observed += len(obs)
        assert all("<tool_response>\n42\n</tool_response>" in text for who, text in e.transcript if who == "env")
    assert observed > 0 and out.metrics()["episode/tool_calls_mean"] > 0
    assert tok.convert_tokens_to_ids("<|im_start|>") in sum((e.tokens for e in out.episodes), [])
    assert_one_forward_logprobs(model, out)


def test_a_trainer_refuses_a_template_without_tools_and_trains_episodes_with_one(tmp_path, tiny):
    from tests.trainer.rl_support import rl_config
    from verl.trainer.rl_trainer import RLTrainer

    config = rl_config(tmp_path, "rollout.max_new_tokens=6", "rollout.stop=[e]", reward=None)
    with pytest.raises(ConfigError, match="the chat template has no tool section"):
        RLTrainer(config, env=_env())  # the tiny model's own ChatML template lists no tools
    trainer = RLTrainer(config, env=_env(tool_call_format="test_e_calls"), tokenizer=tiny[1])
    metrics = trainer.step()
    assert metrics["episode/tool_calls_mean"] > 0 and "actor/pg_loss" in metrics
    first = trainer.tokenizer.decode(trainer.multiturn.run(trainer.env.get_batch(1), 1, trainer.sampling,
                                                           trainer.generator).prompt_ids[0])
    assert "<tools>" in first and '"name": "calculator"' in first  # the prompt lists the tools


def test_the_default_score_compares_the_answers_last_number_with_the_ground_truth(tiny):
    env = ToolEnv([{"prompt": "12*3=", "ground_truth": "36"}], tools=[CALCULATOR])
    env.bind_tokenizer(tiny[1])
    state = env.start(env.get_batch(1)[0])[1]
    assert env.step(state, "It is 36").reward == 1.0 and env.step(state, "It is 35").reward == 0.0
    assert env.step(state, "no number").reward == 0.0


def test_model_chat_template_takes_a_builtin_name_or_a_jinja_file(tmp_path):
    from verl.data.tool_template import chat_template_text

    assert chat_template_text("hermes", None) == HERMES_TEMPLATE
    (tmp_path / "mine.jinja").write_text("{{ messages[0].content }}")
    assert chat_template_text("mine.jinja", str(tmp_path)) == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="model.chat_template='nope.jinja': chat template file nope.jinja does "
                                          "not exist.*built-in template: hermes"):
        chat_template_text("nope.jinja", str(tmp_path))
