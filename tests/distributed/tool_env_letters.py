"""A chat-template tool environment (`verl.env.ToolEnv`) for the asynchronous tests (env.name:
tool_env_letters.py:Letters, on the `tiny:qwen2:64:2:tools` model, whose Hermes template lists the tools).

The random tiny model never writes a `<tool_call>` tag, so the environment reads its turns in a format of its
own (registered like any model family's): a turn that ended at the stop string "e" (its last "e" after its last
"a") calls the `count` tool on its last characters, one that ended at "a" is the final answer. The tool's result comes
back as the template's tool turn (`ToolTurns`), and the answer is scored by its length (dense and varied within a group,
so every step has a gradient)."""

from verl.data.tool_parsers import ParsedTurn, ToolCall, format_hermes, register_tool_call_format
from verl.env import Tool, ToolEnv

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def parse_letters(text: str) -> ParsedTurn:
    if text.rfind("e") > text.rfind("a"):
        return ParsedTurn(text, [ToolCall("count", {"text": text[-6:]})])
    return ParsedTurn(text)


register_tool_call_format("test_letters", parse_letters, format_hermes)


class Letters(ToolEnv):
    def __init__(self, seed=0, shuffle=True, num_rows=40):
        rows = [{"prompt": f"{i}+{i % 7}=", "ground_truth": str(i + i % 7)} for i in range(num_rows)]
        count = Tool("count", "Count the characters of a text.", SCHEMA, lambda text: len(text))
        super().__init__(rows[8:], val_rows=rows[:8], tools=[count], tool_call_format="test_letters", max_turns=3,
                         max_episode_tokens=48, seed=seed, shuffle=shuffle)

    def score(self, row, answer):
        return len(answer) % 4 / 3
